"""`colibri convert HF_DIR OUT_DIR`: a Hugging Face safetensors checkpoint -> a Colibri model directory.

Streams one tensor at a time from memory-mapped shards (`safetensors_checkpoint.py`), so peak memory is bounded
by the largest single tensor (a few float32 copies of it while changing dtype or quantizing), not by the model; an
fp8 checkpoint's block scales (4 bytes per 128x128 block) are all read and checked up front, before OUT_DIR
changes. Pickle checkpoints (.bin/.pt) are never loaded. Routed experts may be stored in another dtype than the rest
(`expert_service/tools/expert_dtypes.py`); fine-grained fp8 checkpoints are read as `hf_fp8.py` describes,
their experts' bytes kept as they are unless another expert dtype is asked for. The LM head may be quantized to
int8 or fp8 with per-row scales (`head_dtype`; a tied checkpoint's from its embedding, which stays dense), and so
may the attention projections (`attention_dtype`), by the same quantize function (`dense_8bit.py`).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from common import dtypes, quant
from common.errors import ConfigError, ModelFormatError
from common.expert_layout import ExpertFormat, scale_name
from common.files import copy_new, stat_regular
from common.model_config import ModelConfig
from common.model_manifest import ATTENTION_MATRIX, HEAD, MANIFEST, expert_file
from common.model_writer import ModelWriter
from common.models import TensorSpec, config_from_hf, family_module, tensor_specs
from common.routing_table import COUNTS_SUFFIX, TABLE_FILE, model_digest, recorded_model_digest
from common.strict_json import parse_json
from expert_service.tools import dense_8bit, hf_fp8
from expert_service.tools.expert_dtypes import load_plan
from expert_service.tools.routing_gen import report_path_for
from expert_service.tools.safetensors_checkpoint import (
    SOURCE_DTYPES,
    SafetensorsShard,
    checkpoint_file,
    open_checkpoint,
    read_checkpoint_file,
)

log = logging.getLogger("colibri.convert")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
FP8_BLOCK = ExpertFormat("float8_e4m3fn", quant.BLOCK128)

# Names in OUT_DIR that belong to the model directory but that a conversion does not rewrite: the routing table
# (the worker reads it by name), its report, and leftovers of a killed write. An earlier model's are removed:
# each describes that model alone. Expert files of layers the new model lacks go too (EXPERT_FILE).
# router-gen's outputs beside the table: its report and (--save-counts) its counts, kept together when it fits
TABLE_OUTPUTS = (TABLE_FILE, report_path_for(Path(TABLE_FILE)).name, TABLE_FILE + COUNTS_SUFFIX)
STALE_OUTPUTS = (*TABLE_OUTPUTS, TABLE_FILE + ".tmp", MANIFEST + ".tmp")
EXPERT_FILE = re.compile(r"experts-L(\d{3,})\.bin")


def _regular_or_absent(path: Path) -> bool:
    """Whether the checkpoint has a regular file (or a link to one) at `path`; anything else there is refused
    before OUT_DIR changes: taken for absent, a FIFO or directory dropped the file without a word."""
    return checkpoint_file(path, stat_regular) is not None


@dataclass(frozen=True)
class DenseFormats:
    """How tensors outside routed experts are stored: the dense dtype, or an 8-bit head / attention projections."""

    dense: ExpertFormat
    head: ExpertFormat | None  # None: the dense dtype
    attention: ExpertFormat | None  # None: the dense dtype

    def of(self, name: str) -> ExpertFormat:
        if name == HEAD and self.head is not None:
            return self.head
        if self.attention is not None and ATTENTION_MATRIX.fullmatch(name):
            return self.attention
        return self.dense


def convert(
    hf_dir: str | Path,
    out_dir: str | Path,
    dtype: str | None = None,
    progress: bool = True,
    expert_dtype: str | None = None,
    fp8_scale: str | None = None,
    expert_dtype_file: str | Path | None = None,
    head_dtype: str | None = None,
    attention_dtype: str | None = None,
) -> Path:
    """`dtype`: every tensor but routed experts' (default: the checkpoint's); `expert_dtype`, `fp8_scale`
    (None: block128, and an fp8 checkpoint's experts keep theirs) and `expert_dtype_file`: the experts'
    (expert_dtypes.py; default: as the checkpoint stores them); `head_dtype`: the LM head's, int8 or fp8 with
    per-row scales, or the dense dtype (None: the dense dtype); `attention_dtype`: the attention projections', as
    the head's."""
    head_name = dense_8bit.dtype_name("--head-dtype", head_dtype)
    attention_name = dense_8bit.dtype_name("--attention-dtype", attention_dtype)
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if out_dir.resolve() == hf_dir.resolve():  # its bin files would land beside the checkpoint before a copy failed
        raise ModelFormatError(f"{out_dir}: the output directory is the checkpoint's; convert into another one")
    config_path = hf_dir / "config.json"
    config_bytes = read_checkpoint_file(config_path)
    if config_bytes is None:
        raise ModelFormatError(f"{config_path}: not found")
    hf_config: Any = parse_json(config_bytes, config_path, ModelFormatError)
    config = config_from_hf(hf_config)  # refuses anything but an object
    fp8 = hf_fp8.read_quantization_config(hf_config, config_path)
    plan = load_plan(config, expert_dtype, fp8_scale, expert_dtype_file)
    with open_checkpoint(hf_dir) as where:  # its maps closed however this is left
        specs = tensor_specs(config)
        missing = [s.hf_name for s in specs if s.hf_name not in where]
        if missing:
            raise ModelFormatError(
                f"{hf_dir}: checkpoint lacks tensor {missing[0]} "
                f"({len(missing)} missing for a {config.family} model of this config)"
            )
        _refuse_unused(where, specs, config.family, hf_dir)
        for spec in specs:  # from the headers, before the writer truncates what OUT_DIR already holds
            src_dtype, shape = where[spec.hf_name].tensors[spec.hf_name]
            if src_dtype not in SOURCE_DTYPES:
                raise ModelFormatError(
                    f"{where[spec.hf_name].path}: tensor {spec.hf_name} has dtype {src_dtype}, "
                    f"supported: {', '.join(SOURCE_DTYPES)}"
                )
            if shape != spec.shape:
                raise ModelFormatError(
                    f"{hf_dir}: tensor {spec.hf_name} has shape {list(shape)}, config.json implies {list(spec.shape)}"
                )
        scales = {s.hf_name: hf_fp8.check_fp8_tensor(fp8, where, s.hf_name, hf_dir) for s in specs}
        # Every block scale's values too, before OUT_DIR changes: one per 128x128 block, so all of them are a small
        # fraction of the weights, and a bad one found while writing left the earlier model there unloadable.
        block_scales = {hf_name: hf_fp8.read_scale(where, scale[0]) for hf_name, scale in scales.items() if scale}
        first_dtype = SOURCE_DTYPES[where[specs[0].hf_name].tensors[specs[0].hf_name][0]]
        if dtype:
            target = dtypes.canonical_dtype(dtype)
        else:  # an fp8 embedding: fp8 checkpoints' dense tensors default to bfloat16
            target = first_dtype if first_dtype in dtypes.DENSE_DTYPES else "bfloat16"
        head_8bit = dense_8bit.eight_bit("--head-dtype", head_name, head_dtype, target)
        attention_8bit = dense_8bit.eight_bit("--attention-dtype", attention_name, attention_dtype, target)
        if attention_8bit is not None:
            dense_8bit.check_attention_sizes(config, str(attention_dtype))
        formats = {
            (s.layer, s.expert): plan.resolve(s.layer, s.expert, target, _stored(specs, scales, s))
            for s in specs
            if s.expert is not None and s.layer is not None and s.name.endswith("gate_proj")
        }
        if plan.fp8_scheme is not None and all(f.dtype != "float8_e4m3fn" for f in formats.values()):
            given = [f"--expert-dtype {expert_dtype}"] if expert_dtype is not None else []
            given += [f"--expert-dtype-file {expert_dtype_file}"] if expert_dtype_file is not None else []
            # the file's fp8_scale, when it has one, is the one in force (flag None: only the file can have asked)
            asked = f"--fp8-scale {fp8_scale}" if fp8_scale is not None else f"{expert_dtype_file}: fp8_scale"
            raise ConfigError(
                f"{asked}: no routed expert is stored fp8 "
                f"({' and '.join(given) or 'no --expert-dtype, and the checkpoint experts are not fp8'}), so it would be "
                "ignored; drop it or give --expert-dtype fp8"
            )
        tokenizer_files = [name for name in TOKENIZER_FILES if _regular_or_absent(hf_dir / name)]
        table_digest = _remove_stale_outputs(out_dir, config, plan.hot_table)
        writer = ModelWriter(
            out_dir, hf_config, target, lambda layer, expert: formats[layer, expert], head_8bit, attention_8bit
        )
        with writer:  # its files closed however this is left
            dense_fmts = DenseFormats(
                ExpertFormat(target),
                ExpertFormat(head_8bit, quant.CHANNEL) if head_8bit else None,
                ExpertFormat(attention_8bit, quant.CHANNEL) if attention_8bit else None,
            )
            _write_tensors(writer, where, specs, formats, block_scales, dense_fmts, progress)
            for name in TOKENIZER_FILES:
                if name in tokenizer_files:
                    copy_new(hf_dir / name, out_dir / name)
                    writer.tokenizer_files.append(name)
                elif _is_file_or_link(out_dir / name):  # an earlier model's: the router would read it as this one's
                    (out_dir / name).unlink()
            written = writer.finish()
    if table_digest is not None:
        _settle_table(out_dir, table_digest)
    return written


def _write_tensors(
    writer: ModelWriter,
    where: dict[str, SafetensorsShard],
    specs: list[TensorSpec],
    formats: dict[tuple[int, int], ExpertFormat],
    block_scales: dict[str, np.ndarray],
    dense_fmts: DenseFormats,
    progress: bool,
) -> None:
    """Every tensor read, converted and written, one at a time (an 8-bit head of a tied checkpoint from its
    embedding). A function of its own: the views into the shards' maps it holds go with its frame, so that the maps
    can close whether the writing completes or fails."""
    head_fmt = dense_fmts.head
    tied_head = head_fmt is not None and writer.config.tie_word_embeddings  # quantized from the embedding
    total = sum(math.prod(s.shape) for s in specs) + (math.prod(specs[0].shape) if tied_head else 0)
    with tqdm(total=total, unit=" params", unit_scale=True, desc="convert", disable=not progress) as bar:
        for spec in specs:
            raw, src_dtype = where[spec.hf_name].read(spec.hf_name)
            if spec.layer is not None and spec.expert is not None:
                fmt = formats[spec.layer, spec.expert]
            else:
                fmt = dense_fmts.of(spec.name)
            block_scale = block_scales.get(spec.hf_name)
            _write(writer, spec, raw, src_dtype, block_scale, fmt)
            bar.update(raw.size)
            if tied_head and spec.name == "embed_tokens":  # one tensor at a time: the dense copy is gone by now
                assert head_fmt is not None
                _write(writer, TensorSpec(HEAD, spec.hf_name, spec.shape), raw, src_dtype, block_scale, head_fmt)
                bar.update(raw.size)


def _remove_stale_outputs(out_dir: Path, config: ModelConfig, hot_table: Path | None) -> str | None:
    """Removes what an earlier model left in OUT_DIR under a name the model directory owns and this conversion does
    not rewrite (STALE_OUTPUTS, expert files of layers this model lacks), saying so in one warning; files of other
    names are never touched. A routing table that records the model it was built for is left until the end
    (`_settle_table`): converting the same checkpoint the same way again (a convert Job run twice) gives the same
    model, whose table stays valid. Returns that table's recorded digest, or None. Refuses, removing nothing, when
    one of the names is the keep_hot table this conversion reads: it is the operator's input, not a leftover."""
    if not out_dir.is_dir():
        return None
    names = [name for name in STALE_OUTPUTS if _is_file_or_link(out_dir / name)]
    kept = {expert_file(layer) for layer in config.moe_layers}
    names += sorted(
        p.name
        for p in out_dir.iterdir()
        if (m := EXPERT_FILE.fullmatch(p.name)) and _is_file_or_link(p) and p.name not in kept
        and expert_file(int(m.group(1))) == p.name  # a name a model directory uses (no experts-L0007.bin)
    )  # fmt: skip
    if hot_table is not None:  # the file at that name itself (a link there to the table leaves the table intact)
        real = {out_dir.resolve() / name: name for name in names}
        if (name := real.get(hot_table.resolve())) is not None:
            raise ConfigError(
                f"--expert-dtype-file: keep_hot.routing_table {hot_table} is {out_dir / name}, which converting into "
                f"{out_dir} removes (it belongs to the model the directory holds now); move it out and name it there"
            )
    table_digest = recorded_model_digest(out_dir / TABLE_FILE) if TABLE_FILE in names else None
    if table_digest is not None:
        names = [name for name in names if name not in TABLE_OUTPUTS]
    for name in names:
        (out_dir / name).unlink()
    if names:
        log.warning(
            "%s: removed %s, left by the model the directory held (they would be read as this model's; rebuild a "
            "routing table with `colibri router-gen`)",
            out_dir,
            ", ".join(names),
        )
    return table_digest


def _settle_table(out_dir: Path, table_digest: str) -> None:
    """The routing table an earlier conversion left, once this one is written: kept when it was built for this very
    model (same colibri.json digest), removed with its report otherwise."""
    if table_digest == model_digest(out_dir):
        log.info("%s: kept %s, built for this same model", out_dir, TABLE_FILE)
        return
    removed = [name for name in TABLE_OUTPUTS if _is_file_or_link(out_dir / name)]
    for name in removed:
        (out_dir / name).unlink()
    log.warning(
        "%s: removed %s, built for the model the directory held (rebuild it with `colibri router-gen`)",
        out_dir,
        ", ".join(removed),
    )


def _is_file_or_link(path: Path) -> bool:
    """A file (or a link, removed as a link) at a name convert removes; a directory there is the operator's, left
    alone (the model directory's readers take only files by those names)."""
    return path.is_symlink() or path.is_file()


def _refuse_unused(where: dict[str, SafetensorsShard], specs: list[TensorSpec], family: str, hf_dir: Path) -> None:
    """Refuses a checkpoint tensor named like one of the family's that this config.json leaves out (a layer
    or expert past its counts, biases it says are absent): dropping it would convert a different model. Other
    names (rotary caches, fp8 scales) are not the family's and stay ignored."""
    templates = family_module(family).HF_NAMES.values()
    named = re.compile("|".join(re.escape(t).replace(r"\{i\}", r"\d+").replace(r"\{j\}", r"\d+") for t in templates))
    used = {s.hf_name for s in specs}
    unused = sorted(name for name in where if name not in used and named.fullmatch(name))
    embed = specs[0].hf_name
    if unused == [family_module(family).HF_NAMES["lm_head"]]:  # tied: a copy of the embedding is harmless
        # a copy down to its fp8 scales: the same bytes times another scale are another matrix
        pairs = [(unused[0] + suffix, embed + suffix) for suffix in ("", *hf_fp8.SCALE_SUFFIXES)]
        if all(_same_tensor(where, head, tied_to) for head, tied_to in pairs):
            return
    if unused:
        raise ModelFormatError(
            f"{hf_dir}: checkpoint tensor {unused[0]} is not part of the {family} model config.json describes "
            f"({len(unused)} such tensors: check num_hidden_layers, the expert count, biases and tie_word_embeddings)"
        )


def _same_tensor(where: dict[str, SafetensorsShard], a: str, b: str) -> bool:
    """Both absent, or both present with one dtype, shape and bytes."""
    if (a in where) != (b in where):
        return False
    if a not in where:
        return True
    if where[a].tensors[a] != where[b].tensors[b]:
        return False
    return np.array_equal(where[a].read(a)[0].view(np.uint8), where[b].read(b)[0].view(np.uint8))  # NaN equals NaN


def _stored(specs: list[TensorSpec], scales: dict, spec: TensorSpec) -> ExpertFormat | None:
    """FP8_BLOCK when the checkpoint stores all three matrices of this expert as block-scaled fp8."""
    prefix = spec.name.removesuffix("gate_proj")
    names = [s.hf_name for s in specs if s.name.startswith(prefix) and s.expert == spec.expert]
    return FP8_BLOCK if all(scales[n] for n in names) else None


def _write(
    writer: ModelWriter, spec: TensorSpec, raw: np.ndarray, src: str, scale: np.ndarray | None, fmt: ExpertFormat
) -> None:
    """One checkpoint tensor in the storage `fmt` asks for: fp8 block bytes kept as they are when the
    format is theirs, else widened (dequantised) to float32 and converted or quantized."""
    if src == "float8_e4m3fn":
        assert scale is not None  # check_fp8_tensor found it
        if np.any((raw & 0x7F) == 0x7F):  # e4m3fn's NaN: the checkpoint is corrupt, never serve it
            raise ModelFormatError(f"tensor {spec.hf_name}: fp8 weights hold NaN bytes (0x7f/0xff)")
        if fmt == FP8_BLOCK:  # kept as they are (read_scale refused scales the reader would)
            writer.write(spec.name, raw)
            writer.write(scale_name(spec.name), scale)
            return
        raw, src = quant.dequantize(raw, scale, src, quant.BLOCK128), "float32"
    if fmt.is_quantized:
        assert fmt.scheme is not None
        q, q_scale = quant.quantize(dtypes.to_float32(raw, src), fmt.dtype, fmt.scheme, spec.hf_name)
        writer.write(spec.name, q)
        writer.write(scale_name(spec.name), q_scale)
        return
    writer.write(spec.name, dtypes.convert(raw, src, fmt.dtype, spec.hf_name))
