"""`colibri complete --model DIR --tokens 1,2,3 --max-new-tokens N`: one offline completion as JSON."""

from __future__ import annotations

import argparse
import json
import random

from common.errors import CapacityError, InvalidRequestError
from expert_service.engine.sampling import SamplingParams
from expert_service.tools.cli.offline import add_model_arguments, open_engine
from expert_service.tools.model_tokenizer import read_tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate (default: 16)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off (default)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past the model's EOS")
    parser.add_argument("--logprobs", action="store_true", help="include each token's log-probability")


# SamplingParams names its fields; the operator typed these flags.
FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed"}
MAX_SEED = (1 << 64) - 1  # the router's seed field (uint64): a seed beyond it could not be replayed there


def sampling_params(args: argparse.Namespace, seed: int) -> SamplingParams:
    """The sampling flags as SamplingParams, checked before the model loads; an error names the flag."""
    if not 0 <= seed <= MAX_SEED:
        raise InvalidRequestError("--seed", f"must be in [0, {MAX_SEED}], got {seed}")
    try:
        return SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=seed, logprobs=args.logprobs
        )
    except InvalidRequestError as e:
        raise InvalidRequestError(FLAGS.get(e.field, e.field), e.detail) from None


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise InvalidRequestError("--max-new-tokens", f"must be >= 1, got {args.max_new_tokens}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**63)
    sampling = sampling_params(args, seed)
    engine, ids = open_engine(args)
    vocab_size = engine.model_config.vocab_size
    if args.top_k > vocab_size:  # refused as the router's API refuses it, not taken as "off"
        raise InvalidRequestError(
            "--top-k", f"must be <= the vocabulary size ({vocab_size}; 0 = off), got {args.top_k}"
        )
    # Checked before generating, as the router does: past the context the engine fails mid-completion and every
    # token generated so far is lost.
    limit = engine.model_config.max_position_embeddings
    if ids.size + args.max_new_tokens > limit:
        raise InvalidRequestError(
            "--max-new-tokens",
            f"prompt ({ids.size} tokens) + max_new_tokens ({args.max_new_tokens}) must be <= "
            f"max_position_embeddings ({limit})",
        )
    # So is a completion the KV cache cannot hold (the last token is sampled, never fed).
    config = engine.config
    blocks, block_size = config.resolved_num_kv_blocks, config.kv_block_size
    needed = ids.size + args.max_new_tokens - 1
    if needed > blocks * block_size:
        raise CapacityError(
            f"--max-new-tokens: prompt ({ids.size} tokens) + max_new_tokens ({args.max_new_tokens}) need {needed} KV "
            f"positions, more than the KV cache's {blocks * block_size} ({blocks} blocks of {block_size} tokens; "
            "raise --num-kv-blocks or --kv-cache-tokens)"
        )
    tokenizer = read_tokenizer(engine.model)  # before generating: a broken one would lose the completion
    stop = () if args.ignore_eos else engine.model_config.eos_token_ids
    tokens, logprobs, reason = engine.generate(ids, args.max_new_tokens, sampling, stop_token_ids=stop)
    result = {
        "token_ids": tokens,
        "stop_reason": reason,
        "prompt_tokens": len(ids),
        "generated_tokens": len(tokens),
        "seed": seed,
    }
    if tokenizer is not None:
        result["text"] = tokenizer.decode(tokens, skip_special_tokens=False)
    if args.logprobs:
        result["logprobs"] = logprobs
    print(json.dumps(result))
    return 0
