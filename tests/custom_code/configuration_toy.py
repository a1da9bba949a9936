"""A custom-code architecture nncanon has no record of (tests load it with trust_remote_code=True)."""

from transformers import PretrainedConfig


class ToyConfig(PretrainedConfig):
    model_type = "nncanon_toy"

    def __init__(self, vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, block_style="inside", residual_scale=0.5, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.block_style = block_style
        self.residual_scale = residual_scale
        super().__init__(**kwargs)
