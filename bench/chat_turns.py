"""How much of a chat's next turn the prefix cache serves: five-turn conversations through the router's gRPC Chat
(real router and CPU worker on loopback, a converted model with a chat template, greedy, ignore_eos), each turn's
prompt the previous one, its answer and a new user message. Per turn: prompt tokens, cached tokens, and the most the
cache could serve: the whole blocks of the previous prompt and answer (its last token is never fed), short of the
prompt's last token. Answers of 8 and 96 tokens.

    colibri convert training/default-model-hf /tmp/dm
    python bench/chat_turns.py /tmp/dm --out bench/results/cpu-chat-turns.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.pb import router_pb2 as rpb  # noqa: E402
from tests.helpers import BackgroundWorker, running_router  # noqa: E402

SYSTEM = "You answer questions about the Bible."
QUESTIONS = ("Who was Moses?", "And Aaron?", "What did they do in Egypt?", "Where did they go then?", "What happened?")


async def conversation(stub, answer_tokens: int, block: int) -> list[dict]:
    messages, rows, previous = [rpb.ChatMessage(role="system", content=SYSTEM)], [], None
    params = rpb.SamplingParameters(max_new_tokens=answer_tokens, ignore_eos=True)
    for question in QUESTIONS:
        messages.append(rpb.ChatMessage(role="user", content=question))
        answer = await stub.Chat(rpb.ChatRequest(messages=messages, parameters=params))
        fed = 0 if previous is None else previous - 1
        could = min(fed // block, (answer.prompt_tokens - 1) // block) * block
        rows.append({"prompt": answer.prompt_tokens, "cached": answer.cached_prompt_tokens, "could": could})
        previous = answer.prompt_tokens + len(answer.token_ids)
        messages.append(rpb.ChatMessage(role="assistant", content=answer.text))
    return rows


async def main(model: Path, block: int) -> dict:
    worker = BackgroundWorker(model, kv_block_size=block, kv_cache_tokens=16384, max_batch_tokens=2048).start()
    try:
        out = {}
        for answer_tokens in (8, 96):
            # a router of its own: the conversations share nothing but what the model's template adds
            async with running_router(worker.address, model=str(model)) as (_, stub):
                rows = await conversation(stub, answer_tokens, block)
            later = rows[1:]
            out[answer_tokens] = {
                "turns": rows,
                "cached": sum(r["cached"] for r in later),
                "could": sum(r["could"] for r in later),
            }
            print(f"{answer_tokens}-token answers: turns 2-5 cached {out[answer_tokens]['cached']} of "
                  f"{out[answer_tokens]['could']} tokens; {rows}", flush=True)  # fmt: skip
        return out
    finally:
        worker.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="a converted model directory with a chat template")
    parser.add_argument("--block", type=int, default=16, help="KV block size")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = {"model": str(args.model), "block": args.block, "answers": asyncio.run(main(args.model, args.block))}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
