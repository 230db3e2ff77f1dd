"""Small random-initialised Hugging Face models of every supported architecture, for tests."""

import torch
import transformers as tf

SMALL = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 99}

CONFIGS = {
    "bert": lambda: tf.BertConfig(**SMALL, intermediate_size=64),
    "roberta": lambda: tf.RobertaConfig(**SMALL, intermediate_size=64, pad_token_id=1),
    "electra": lambda: tf.ElectraConfig(**SMALL, intermediate_size=64, embedding_size=16),
    "distilbert": lambda: tf.DistilBertConfig(
        vocab_size=99, dim=32, n_heads=4, n_layers=2, hidden_dim=64
    ),
    "albert": lambda: tf.AlbertConfig(
        **SMALL | {"num_hidden_layers": 3}, intermediate_size=64, embedding_size=16
    ),
    "gpt2": lambda: tf.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=99, n_positions=64),
    "gpt_neox": lambda: tf.GPTNeoXConfig(**SMALL, intermediate_size=64),
    "opt": lambda: tf.OPTConfig(**SMALL, ffn_dim=64, word_embed_proj_dim=32, pad_token_id=1),
    "llama": lambda: tf.LlamaConfig(**SMALL, intermediate_size=64, num_key_value_heads=2),
    "mistral": lambda: tf.MistralConfig(
        **SMALL, intermediate_size=64, num_key_value_heads=2, sliding_window=4
    ),
    "qwen2": lambda: tf.Qwen2Config(**SMALL, intermediate_size=64, num_key_value_heads=2),
    "qwen3": lambda: tf.Qwen3Config(
        **SMALL, intermediate_size=64, num_key_value_heads=2, head_dim=8
    ),
    # Windows of 4 tokens on every other layer, and soft-capping at a cap the scores reach.
    "gemma2": lambda: tf.Gemma2Config(
        **SMALL, intermediate_size=64, num_key_value_heads=2, head_dim=8, sliding_window=4,
        query_pre_attn_scalar=8, attn_logit_softcapping=0.5, pad_token_id=0,
    ),
    "gemma3_text": lambda: tf.Gemma3TextConfig(
        **SMALL, intermediate_size=64, num_key_value_heads=2, head_dim=8, sliding_window=4,
        query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0,
    ),
    "phi3": lambda: tf.Phi3Config(
        **SMALL, intermediate_size=64, num_key_value_heads=2, pad_token_id=0
    ),
    "modernbert": lambda: tf.ModernBertConfig(
        **SMALL, intermediate_size=64, local_attention=4, global_attn_every_n_layers=2,
        pad_token_id=0, attention_bias=True,
    ),
}  # fmt: skip
_SEQ2SEQ = {
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "vocab_size": 99,
    "pad_token_id": 1,
    "decoder_start_token_id": 2,
}
_T5 = {"d_model": 32, "num_heads": 4, "num_layers": 2, "d_kv": 8, "d_ff": 64, "vocab_size": 99}
SEQ2SEQ = {
    "bart": lambda: tf.BartConfig(**_SEQ2SEQ),  # post-LayerNorm
    "mbart": lambda: tf.MBartConfig(**_SEQ2SEQ),  # pre-LayerNorm
    "marian": lambda: tf.MarianConfig(**_SEQ2SEQ),
    "t5": lambda: tf.T5Config(**_T5, relative_attention_num_buckets=8),
    "flan-t5": lambda: tf.T5Config(
        **_T5, feed_forward_proj="gated-gelu", relative_attention_num_buckets=8
    ),
}  # fmt: skip
ENCODERS = {"bert", "roberta", "electra", "distilbert", "albert", "modernbert"}
ROTARY = {
    "gpt_neox", "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3",
    "modernbert",
}  # fmt: skip


def small_model(kind: str, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    config = (CONFIGS | SEQ2SEQ)[kind]()
    model = tf.AutoModel.from_config(config, **kwargs).eval()
    # Random-initialised biases start at zero; make them count in the checks.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def padded_batch(kind: str, seed: int = 0):
    """Lengths 7, 5 and 3: right-padded for encoders, left-padded for decoders."""
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 5, 3]
    ids = torch.randint(3, 99, (3, 7), generator=g)
    mask = (torch.arange(7)[None] < torch.tensor(lengths)[:, None]).long()
    if kind not in ENCODERS:
        mask = mask.flip(1)
    return {"input_ids": ids, "attention_mask": mask}


def seq2seq_batch(seed: int = 0):
    """Sources of 7, 5 and 3 tokens and targets of 6, 4 and 2, right-padded."""
    g = torch.Generator().manual_seed(seed)

    def padded(lengths, width):
        mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
        return torch.randint(3, 99, (len(lengths), width), generator=g), mask

    ids, mask = padded([7, 5, 3], 7)
    target, target_mask = padded([6, 4, 2], 6)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "decoder_input_ids": target,
        "decoder_attention_mask": target_mask,
    }


def saved_bert(folder, seed: int = 0):
    """A small random BERT and a WordPiece tokenizer saved in ``folder``, as a user's local
    model (vocabulary 200, enough for the test tokenizer); returns the folder."""
    from tokenizers_util import wordpiece

    torch.manual_seed(seed)
    config = tf.BertConfig(**SMALL | {"vocab_size": 200}, intermediate_size=64)
    tf.BertModel(config).save_pretrained(folder)
    wordpiece().save_pretrained(folder)
    return folder
