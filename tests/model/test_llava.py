"""A tiny random-weight LLaVA (CLIP tower + projector + Llama) built from a config: our engine
against transformers' LlavaForConditionalGeneration, image tokens in the radix key, bad images.
"""

from __future__ import annotations

import pytest
import torch

from server.scheduler.validation import InvalidRequestError
from tests.helpers import IMAGE_TOKEN, huge_png, png


@pytest.fixture(scope="module")
def engine(tiny_llava):
    from server.engine import Engine

    return Engine(tiny_llava[0], dtype="float32", context_length=256, max_total_tokens=2048)


def test_logits_match_transformers_for_image_and_text(tiny_llava, engine):
    """Every prompt position's next-token logprob (image positions, the text after them)
    within 1e-4 of transformers in fp32."""
    path, hf = tiny_llava
    text = engine.encode("Describe <image> in one word:")
    ids, images = engine.images.expand(text, [png(1)])
    assert ids.count(IMAGE_TOKEN) == engine.vision_spec.tokens_per_image == 4
    out = engine.generate(input_ids=ids, image_data=[png(1)], return_logprob=True,
                          logprob_start_len=0, sampling_params={"max_new_tokens": 1,
                                                                "temperature": 0})
    from server.model.vision import ImageProcessor

    pixels = ImageProcessor(path)(png(1))
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
    want = torch.log_softmax(logits.float(), -1)
    got = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
    ref = [want[i, t].item() for i, t in enumerate(ids[1:])]
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4
    assert out["output_ids"][0] == int(want[-1].argmax())


def test_same_image_is_cached_a_different_one_is_not(engine):
    engine.flush_cache()
    ids = engine.encode("Q: <image> what is it? A:")
    sp = {"max_new_tokens": 2, "temperature": 0}
    first = engine.generate(input_ids=ids, image_data=[png(2)], sampling_params=sp)
    again = engine.generate(input_ids=ids, image_data=[png(2)], sampling_params=sp)
    other = engine.generate(input_ids=ids, image_data=[png(3)], sampling_params=sp)
    n = first["meta_info"]["prompt_tokens"]
    before_image = ids.index(IMAGE_TOKEN)
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == n - 1  # the whole prompt but the last token
    assert again["output_ids"] == first["output_ids"]
    assert other["meta_info"]["cached_tokens"] == before_image  # only the text before it


def test_bad_images_are_refused_and_change_nothing(engine):
    ids = engine.encode("Look: <image>")
    before = engine.metrics()
    for bad, match in [(b"not an image", "decodable"), (png(4)[:60], "decoded"),
                       (huge_png(), "pixels")]:
        with pytest.raises(InvalidRequestError, match=match):
            engine.generate(input_ids=ids, image_data=[bad])
    with pytest.raises(InvalidRequestError, match="image placeholders"):
        engine.generate(input_ids=ids, image_data=[png(4), png(5)])
    after = engine.metrics()
    assert after["prompt_tokens"] == before["prompt_tokens"]
    assert after["kv_free_tokens"] == before["kv_free_tokens"]


def test_an_image_is_encoded_once_and_not_at_all_when_cached(tiny_llava):
    """Chunked prefill cutting through the image's positions encodes it once; a repeat of the
    prompt finds the image's positions cached and does not encode it."""
    from server.engine import Engine

    eng = Engine(tiny_llava[0], dtype="float32", context_length=256, max_total_tokens=2048,
                 chunked_prefill_size=3)
    calls = []
    encode = eng.runner.vision.encode
    eng.runner.vision.encode = lambda pixels: calls.append(1) or encode(pixels)
    ids = eng.encode("An <image> and a question:")
    sp = {"max_new_tokens": 2, "temperature": 0}
    first = eng.generate(input_ids=ids, image_data=[png(6)], sampling_params=sp)
    assert len(calls) == 1
    again = eng.generate(input_ids=ids, image_data=[png(6)], sampling_params=sp)
    assert len(calls) == 1 and again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1
