"""Four blocks no transformers family has, chosen by ``config.block_style``:

- ``inside``: attention and MLP add the residual themselves (``residual + out(ctx)``);
- ``scaled``: each sublayer is scaled by ``residual_scale`` before it joins the stream;
- ``sandwich``: each sublayer is normed after it runs (a post-norm);
- ``parallel``: attention and MLP read the same normed stream, added in one expression.
"""

import math

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_toy import ToyConfig


class ToyAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads = config.num_attention_heads
        self.width = config.hidden_size
        self.qkv = nn.Linear(self.width, 3 * self.width)
        self.out = nn.Linear(self.width, self.width)

    def forward(self, x, residual=None):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        mask = torch.full((s, s), float("-inf"), device=x.device, dtype=scores.dtype).triu(1)
        probs = torch.softmax(scores + mask, dim=-1)
        context = (probs @ v).transpose(1, 2).reshape(b, s, d)
        out = self.out(context)
        return out if residual is None else residual + out


class ToyFeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x, residual=None):
        out = self.down(nn.functional.gelu(self.up(x)))
        return out if residual is None else residual + out


class ToyBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.style = config.block_style
        self.scale = config.residual_scale
        self.ln_1 = nn.LayerNorm(config.hidden_size)
        self.attention = ToyAttention(config)
        # (a parallel block builds a second norm it never calls: its values are declined, "does not run")
        self.ln_2 = nn.LayerNorm(config.hidden_size)
        self.feed_forward = ToyFeedForward(config)
        if self.style == "sandwich":
            self.post_attention_norm = nn.LayerNorm(config.hidden_size)
            self.post_feed_forward_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, x):
        if self.style == "inside":
            h = self.attention(self.ln_1(x), residual=x)
            return self.feed_forward(self.ln_2(h), residual=h)
        if self.style == "scaled":
            h = x + self.scale * self.attention(self.ln_1(x))
            return h + self.scale * self.feed_forward(self.ln_2(h))
        if self.style == "sandwich":
            h = x + self.post_attention_norm(self.attention(self.ln_1(x)))
            return h + self.post_feed_forward_norm(self.feed_forward(self.ln_2(h)))
        normed = self.ln_1(x)
        return x + self.attention(normed) + self.feed_forward(normed)


class ToyForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = ToyConfig
    base_model_prefix = "toy"

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(ToyBlock(config) for _ in range(config.num_hidden_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size)
        self.unembed = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.unembed

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        return CausalLMOutput(logits=self.unembed(self.final_norm(hidden)))
