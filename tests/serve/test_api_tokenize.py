"""vLLM's tokenizer endpoints (serve/api_tokenize.py) on the embedded tokenizer: what lm-evaluation-
harness's remote tokenizer reads from them (the EOS id by tokenizing the EOS text, round trips), and
the chat form, which must give the chat endpoint's prompt."""

import functools

import pytest

from serve import multimodal
from serve.api_tokenize import Detokenize, TokenizeChat, TokenizeCompletion, detokenize, tokenizer_info
from serve.chat import tokenize_messages
from serve.llm import default_model_dir, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_dir())


def tokenize(tokenizer, body, max_model_len):
    """The handler as the route calls it, on a model without a vision tower."""
    from serve.api_tokenize import tokenize as handler

    return handler(tokenizer, body, max_model_len,
                   functools.partial(multimodal.chat_prompt, tokenizer=tokenizer, processor=None))


def test_text_round_trips_and_special_text_is_the_special_token(tokenizer):
    info = tokenizer_info(tokenizer, 2048)
    assert info["model_max_length"] == 2048 and info["vocab_size"] == tokenizer.vocab_size
    eos = tokenize(tokenizer, TokenizeCompletion(prompt=info["eos_token"], add_special_tokens=False), 2048)
    assert eos["tokens"] == [tokenizer.token_id(info["eos_token"])] and eos["count"] == 1
    assert info["added_tokens_decoder"][str(eos["tokens"][0])]["content"] == info["eos_token"]
    text = "Grüße, K3! <|open|>"
    out = tokenize(tokenizer, TokenizeCompletion(prompt=text, return_token_strs=True), 2048)
    assert out["count"] == len(out["tokens"]) and "".join(out["token_strs"]).startswith("Gr")
    assert tokenizer.token_id("<|open|>") == out["tokens"][-1]
    assert detokenize(tokenizer, Detokenize(tokens=out["tokens"]), tokenizer.vocab_size) == {"prompt": text}


def test_chat_form_is_the_chat_endpoints_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    body = TokenizeChat(messages=messages, chat_template_kwargs={"thinking": False})
    want = tokenize_messages(tokenizer, messages, thinking=False)
    assert tokenize(tokenizer, body, 64)["tokens"] == want
    thinking = TokenizeChat(messages=messages, reasoning_effort="low", add_generation_prompt=False)
    assert tokenize(tokenizer, thinking, 64)["tokens"] == tokenize_messages(
        tokenizer, messages, thinking=True, thinking_effort="low", add_generation_prompt=False)
    json_format = TokenizeChat(messages=messages, response_format={"type": "json_object"})
    assert tokenize(tokenizer, json_format, 64)["tokens"] == tokenize_messages(
        tokenizer, messages, response_format={"type": "json_object"})


def test_ids_outside_the_vocabulary_name_the_field(tokenizer):
    with pytest.raises(ValueError, match=r"^tokens: token ids must lie in \[0, 512\)"):
        detokenize(tokenizer, Detokenize(tokens=[1, 512]), 512)


def test_a_chats_image_is_refused_by_part_without_a_vision_tower(tokenizer):
    """Without a vision tower (the handler here gets no image processor) an image part is a 400
    naming it, as in a chat request (the counts of images a tower reads: tests/serve/test_api_images.py)."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[1\]: this model has no vision tower"):
        tokenize(tokenizer, TokenizeChat(messages=messages), 64)
