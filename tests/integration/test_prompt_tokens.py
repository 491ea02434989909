"""Prompt tokenisation with cached pieces (clients/prompt_tokens.py) gives exactly llama.cpp's tokens, on the
bundled Qwen tokenizer, for chat prompts and for text that plays with special tokens."""

from __future__ import annotations

import pytest
from llama_cpp import Llama

from app.tools import REPO_ROOT
from app.tools.training.corpus import load_prompts
from clients.chat_template import render_chat
from clients.prompt_tokens import PromptTokenizer
from deploy.models import model_path


@pytest.fixture(scope="module")
def qwen() -> Llama:
    return Llama(model_path=str(model_path("qwen2.5-coder-0.5b-instruct")), n_ctx=64, vocab_only=True, verbose=False)


def _direct(llm: Llama, text: str) -> list[int]:
    return llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)


def test_cached_pieces_give_llama_cpp_s_tokens(qwen: Llama) -> None:
    tokenizer = PromptTokenizer(qwen)
    assert tokenizer.cached  # Qwen's special tokens allow it
    template = qwen.metadata["tokenizer.chat_template"]
    prompts = load_prompts(REPO_ROOT / "deploy" / "adapter_prompts.txt")
    assert len(prompts) > 500
    history: list[dict] = [{"role": "system", "content": "You answer briefly."}]
    texts = []
    for prompt in prompts:
        texts.append(render_chat(template, [{"role": "user", "content": prompt}]))
        history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": prompt[::-1]}]
        texts.append(render_chat(template, history[-9:]))  # a conversation: its pieces come back every turn
    texts += [
        "",
        "<|im_start|>",
        "<|im_start|><|im_end|>",
        "plain text, no special tokens at all",
        "  <|im_start|>user\n  spaced  <|im_end|>  \n\n",
        "</s>a</s></tool_call><tool_call>x<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
        "<|im_start|user <|im_end> <|unknown|> <|endoftext|>é漢字🙂\r\n\t",
    ]
    for round_ in range(2):  # the second round is answered from the cache
        for text in texts:
            assert tokenizer(text) == _direct(qwen, text), (round_, text[:80])
