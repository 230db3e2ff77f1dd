"""Small tokenizers of the three families, trained in the test with the `tokenizers` library."""

from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

TEXT = [
    "The cat sat on the mat.",
    "Unbelievably, the dogs were barking at strangers.",
    "She gave her brother a wonderful book yesterday.",
    "Tokenization splits rare words into pieces.",
] * 20


def wordpiece(mask: bool = False) -> PreTrainedTokenizerFast:
    """BERT's kind; with ``mask``, also a [MASK] token (for a masked language model)."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", *(["[MASK]"] if mask else [])]
    tok.train_from_iterator(TEXT, trainers.WordPieceTrainer(vocab_size=120, special_tokens=special))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        **({"mask_token": "[MASK]"} if mask else {}),
    )


def byte_level_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


def unigram() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=100, special_tokens=["<pad>", "<unk>", "</s>"], unk_token="<unk>"
    )
    tok.train_from_iterator(TEXT, trainer)
    eos = tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", eos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>"
    )


FAMILIES = {"wordpiece": wordpiece, "byte_level_bpe": byte_level_bpe, "unigram": unigram}
