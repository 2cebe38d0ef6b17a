"""DSpark drafter (`model.md` §6.1): three V4.1 stages, KV injection, Markov and confidence heads.

The target never enters the draft residual stream. Its hidden features (stream means of the
residual entering the three target layers) become, per stage, one context K=V row per committed
position (`inject_context`). A draft block `[anchor, noise × 4]` at positions p..p+4 then runs the
stages once; each block row attends to the stage's last min(p, W) context rows, all block rows
(non-causal) and the sink. The Markov head turns the block's base logits into drafts serially.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from engine.models.deepseek_v41.attention import Attention, KVCodecs, RMSNorm
from engine.models.deepseek_v41.config import DeepseekV41Config
from engine.models.deepseek_v41.dense import Linear, grouped_linear
from engine.models.deepseek_v41.primitives import apply_rope, mhc_combine

_NEG_INF = float("-inf")


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        # Uninitialised, as the text model's embedding (the weights are loaded).
        self.embed = nn.Embedding(vocab, rank, _weight=torch.empty(vocab, rank, dtype=dtype))
        self.head = Linear(rank, vocab, dtype)

    def bias(self, prev: Tensor) -> Tensor:
        """fp32 logit correction [B, V] given the previous token of each row."""
        return self.head.forward_fp32(self.embed(prev))


class ConfidenceHead(nn.Module):
    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = Linear(width, 1, dtype)


@dataclass
class DraftOutput:
    """base_logits: fp32 [B, S, V] before the Markov correction; logits: after it (the draft
    distribution); drafts: [B, S] token ids; confidence: [B, S] probabilities in (0, 1)."""

    base_logits: Tensor
    logits: Tensor
    drafts: Tensor
    confidence: Tensor


def _stage_attention(
    attn: Attention,
    x: Tensor,
    positions: Tensor,
    context: Tensor,
    context_pos: Tensor,
    codecs: KVCodecs,
) -> Tensor:
    """Block rows x [B, S, D] at positions [B, S] over context rows [B, W, hd] (+ block + sink)."""
    cfg = attn.cfg
    b, s, _ = x.shape
    h, hd = cfg.num_attention_heads, cfg.head_dim
    q_latent, kv_latent = attn.latents(x)
    qa = attn.q_norm(q_latent)
    q = apply_rope(attn.wq_b(qa).view(b, s, h, hd), positions, attn.freqs)
    kv = attn.kv_norm.rotated(kv_latent, positions, attn.freqs)
    own = codecs.swa.decode(codecs.swa.encode(kv))
    keys = torch.cat((context, own), 1)  # [B, W + S, hd]
    logits = torch.einsum("bshd,bkd->bshk", q.float(), keys) * hd**-0.5
    valid = torch.cat((context_pos >= 0, torch.ones(b, s, dtype=torch.bool, device=x.device)), 1)
    logits = logits.masked_fill(~valid[:, None, None, :], _NEG_INF)
    sink = attn.attn_sink.float()[None, None, :, None].expand(b, s, h, 1)
    probs = torch.cat((logits, sink), -1).softmax(-1)[..., :-1]
    o = torch.einsum("bshk,bkd->bshd", probs, keys).to(x.dtype)
    o = apply_rope(o, positions, attn.freqs, inverse=True)
    return attn.wo_b(grouped_linear(attn.wo_a, o.flatten(2), cfg.o_groups))


class DSpark(nn.ModuleList):
    """The drafter: a list of stages registered on the target as `mtp` (names `mtp.{s}.…`)."""

    def __init__(
        self,
        cfg: DeepseekV41Config,
        freqs: Tensor,
        dtype: torch.dtype,
        quantized_experts: bool = False,
    ) -> None:
        from engine.models.deepseek_v41.model import Block

        super().__init__(
            Block(
                cfg,
                cfg.num_hidden_layers + s,
                freqs,
                cfg.dspark_n_routed_experts,
                cfg.dspark_num_experts_per_tok,
                dtype,
                quantized_experts,
            )
            for s in range(cfg.num_nextn_predict_layers)
        )
        self.cfg = cfg
        d, first, last = cfg.hidden_size, self[0], self[-1]
        first.main_proj = Linear(3 * d, d, dtype)
        first.main_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        last.norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        last.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank, dtype)
        last.confidence_head = ConfidenceHead(d + cfg.dspark_markov_rank, dtype)

    def context_rows(self, features: Tensor, positions: Tensor, codecs: KVCodecs) -> list[Tensor]:
        """Per stage, the stored context rows for target features [T, 3·D] at positions [T]."""
        first = self[0]
        c = first.main_norm(first.main_proj(features.to(first.main_norm.weight.dtype)))
        rows = []
        for stage in self:
            attn = stage.attn
            kv = attn.kv_norm.rotated(attn.wkv(c), positions, attn.freqs)
            rows.append(codecs.swa.encode(kv))
        return rows

    def draft(
        self,
        anchors: Tensor,
        positions: Tensor,
        context: list[Tensor],
        context_pos: Tensor,
        embed: nn.Embedding,
        head: Linear,
        codecs: KVCodecs,
        temperature: Tensor | None = None,
        generator: torch.Generator | None = None,
        confidence_temperature: Tensor | None = None,
        choose: Callable[[int, Tensor], Tensor] | None = None,
    ) -> DraftOutput:
        """Draft `block_size` tokens per sequence.

        anchors [B]: last sampled, not yet cached token; positions [B]: its position p.
        context[s]: stored context rows [B, W, row] of stage s for positions context_pos [B, W]
        (−1 = absent). temperature [B] (0 or None = greedy Markov steps). choose(s, z): the
        draft of Markov step s from its corrected logits z [B, V] (the engine's position-keyed
        sampling); replaces `temperature`/`generator` when given.
        """
        cfg = self.cfg
        size = cfg.dspark_block_size
        b = anchors.shape[0]
        ids = torch.full(
            (b, size), cfg.dspark_noise_token_id, dtype=torch.long, device=anchors.device
        )
        ids[:, 0] = anchors
        pos = positions[:, None] + torch.arange(size, device=anchors.device)[None, :]
        x = embed(ids).flatten(0, 1)  # [B·S, D]
        residual = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre_prev = None
        for stage, ctx_rows in zip(self, context, strict=True):
            ctx_keys = codecs.swa.decode(ctx_rows)

            def mixer(x_attn: Tensor, _ctx: object, attn=stage.attn, keys=ctx_keys) -> Tensor:
                out = _stage_attention(
                    attn, x_attn.view(b, size, -1), pos, keys, context_pos, codecs
                )
                return out.flatten(0, 1)

            residual, pre_prev = stage(residual, pre_prev, None, mixer)
        last = self[-1]
        hidden = mhc_combine(residual, pre_prev).view(b, size, -1)
        base = head.forward_fp32(last.norm(hidden))
        markov, conf_head = last.markov_head, last.confidence_head
        prev = anchors
        logits, drafts, conf = [], [], []
        for s in range(size):  # serial only in the cheap rank-r Markov head
            z = base[:, s] + markov.bias(prev)
            feat = torch.cat((hidden[:, s].float(), markov.embed(prev).float()), -1)
            c = conf_head.proj.forward_fp32(feat)
            if confidence_temperature is not None:
                c = c / confidence_temperature[s]
            conf.append(torch.sigmoid(c.squeeze(-1)))
            nxt = z.argmax(-1) if choose is None else choose(s, z)
            if temperature is not None and choose is None:
                t = temperature.clamp(min=1e-6)[:, None]
                sampled = torch.multinomial((z / t).softmax(-1), 1, generator=generator).squeeze(-1)
                nxt = torch.where(temperature > 0, sampled, nxt)
            logits.append(z)
            drafts.append(nxt)
            prev = nxt
        return DraftOutput(
            base_logits=base,
            logits=torch.stack(logits, 1),
            drafts=torch.stack(drafts, 1),
            confidence=torch.stack(conf, 1),
        )
