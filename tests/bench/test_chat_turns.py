"""bench/chat_turns.py on the trained default model: every later turn of a chat starts on all the whole blocks of
the previous prompt and answer (the answer's blocks are cached as it is generated, and the model's template renders
a reply back as the model wrote it)."""

import asyncio

from bench.chat_turns import main
from expert_service.tools.convert import convert
from training.corpus import DATA_DIR


def test_every_turn_starts_on_the_previous_prompt_and_answer(tmp_path):
    model = convert(DATA_DIR.parent / "default-model-hf", tmp_path / "dm", "bfloat16", False)
    result = asyncio.run(main(model, 16))
    for answer_tokens, entry in result.items():
        later = entry["turns"][1:]
        assert all(row["cached"] == row["could"] > 0 for row in later), (answer_tokens, entry["turns"])
