"""A batch on the real model (tiny llama GGUF) never holds more than n_batch tokens: a DECODE
continuing a PREFILL decodes from its first step, beside another slot's prompt that takes
whole batches (engine.stepper's ``_fill_batch``; llama-cpp-python's batch holds n_batch)."""
from __future__ import annotations

import asyncio

import pytest

from tests.test_prompt_cache_llama import SYSTEM, cont, prefill, real_engine, run

N_BATCH = 32


@pytest.mark.asyncio
async def test_a_decode_beside_a_prompt_of_whole_batches_fits_the_batch(tiny_model_path):
    async with real_engine(tiny_model_path, n_batch=N_BATCH) as eng:
        alone = await run(eng, prefill(1, "Ann asks: why?"))
        expected = await run(eng, cont(1, 16))
        await run(eng, prefill(1, "Ann asks: why?"))
        long = eng.submit(prefill(0, SYSTEM))  # ~560 tokens: 18 batches of 32
        decode = eng.submit(cont(1, 16))  # its logits kept by the prefill: a token in the first batch
        both = await asyncio.wait_for(asyncio.gather(long.result(), decode.result()), 120)
    assert both[0].prompt_tokens > 10 * N_BATCH and alone.prompt_tokens < N_BATCH
    assert both[1].generated == expected.generated and len(expected.generated) == 16
