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


JSON_CORPUS = [
    '{"name": "alice", "age": 31, "ok": true, "tags": ["a", "b"]}',
    '{"city": "paris", "zip": "75001", "items": [1, 2, 3], "price": 4.5, "note": null}',
    '[{"id": 7, "done": false}, {"id": 12, "done": true}]',
    "yes no maybe positive negative neutral",
    "abc-123 def-456 call get_weather location unit celsius fahrenheit",
]


def json_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (every byte is a token, plus merges learnt from a little JSON), so structured outputs can
    spell anything; trained in-process, deterministically. Its EOS is `</s>` (id 1)."""
    from tokenizers import decoders, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(JSON_CORPUS * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast
