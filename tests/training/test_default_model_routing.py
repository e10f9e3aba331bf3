"""On the trained default model, a routing table built from text predicts routing far above chance.

Small enough for CI: the table is built from the first 9k tokens of the held-out books and scored on the
next 3k (`colibri router-gen` over the whole training corpus: docs/default-model.md).
"""

import numpy as np
import pytest

from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.tools.routing_gen import generate

CORPUS_TOKENS = 12288
HOLDOUT = 0.25
SEQUENCE_LENGTH = 256
# Measured on exactly this set-up: recall per layer 0.928 0.859 0.819 0.776 0.743 0.736 (0.810 overall);
# the embedding fallback alone 0.302; chance 0.25. The bounds leave that ~0.1 of room.
MIN_LAYER_RECALL = 0.6
MIN_RECALL = 0.7
MIN_GAIN_OVER_FALLBACK = 0.35


@pytest.mark.slow  # about 20 s of router-gen
def test_router_gen_recall_is_far_above_chance(default_model_bf16, heldout_ids):
    model = ModelDir.open(default_model_bf16)
    config = model.config
    engine = build_engine(model, EngineConfig(backend="cpu", max_batch_tokens=4096, kv_cache_tokens=8192))
    corpus = np.asarray(heldout_ids[:CORPUS_TOKENS], dtype=np.int64)
    _, report, _ = generate(model, engine, corpus, config.num_experts_per_tok, HOLDOUT, SEQUENCE_LENGTH)
    chance = config.num_experts_per_tok / config.num_experts
    summary = (
        f"recall per layer {np.round(report['recall_per_layer'], 3).tolist()}, overall {report['recall']:.3f}, "
        f"fallback {report['fallback_recall']:.3f}, chance {chance}"
    )
    assert min(report["recall_per_layer"]) >= MIN_LAYER_RECALL, summary
    assert report["recall"] >= MIN_RECALL, summary
    assert report["recall"] - report["fallback_recall"] >= MIN_GAIN_OVER_FALLBACK, summary
