"""A tiny word-level tokenizer built with the `tokenizers` library (no hub), with a chat template."""

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def tiny_tokenizer(vocab_size: int = 256) -> PreTrainedTokenizerFast:
    specials = ["<pad>", "</s>", "<user>", "<assistant>", "<system>"]
    words = [f"w{i}" for i in range(vocab_size - len(specials))]
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast
