"""Draft-head training: distil an MTP-structured head from the target on plain text, then
quantize it to 4 bits.

The teacher is the target itself: for a sequence t_0..t_{L-1} its final-normed hidden states h_i
and next-token distributions p_i. The head at position i sees (embed(t_{i+1}), h_i) and is trained
to match p_{i+1} (the distribution of t_{i+2}): the cross-entropy of the head against p_{i+1}
restricted to its top-k tokens (sparse distillation; KL up to a constant). Only the head learns;
the embedding and LM head stay the target's. The teacher is frozen, so its outputs for a pool of
training batches are computed once."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from backboard.config import ModelConfig
from backboard.engine.tokenizer import Tokenizer
from backboard.forward_context import set_forward_context
from backboard.models.loader import Checkpoint, load_model, load_weights
from backboard.models.mtp import MTPHead
from backboard.spec_decode.draft_head import quantize_head, save_draft_head
from backboard.worker.input_batch import BatchRequest, prepare_batch
from backboard.worker.memory import allocate_caches

logger = logging.getLogger(__name__)


class Teacher:
    """The target over flat batches of whole sequences: hidden states and logits of every row."""

    def __init__(self, cfg: ModelConfig, batch_size: int, seq_len: int, block_size: int = 16) -> None:
        self.model = load_model(cfg)
        self.bs = block_size
        per = -(-seq_len // block_size)
        self.caches = allocate_caches(cfg, per * batch_size, block_size, batch_size, torch.float32)
        self.blocks = [list(range(i * per, (i + 1) * per)) for i in range(batch_size)]

    @torch.inference_mode()
    def __call__(self, seqs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """seqs [B, L] -> hidden [B, L, H], logits [B, L, V]."""
        B, L = seqs.shape
        pb = prepare_batch([BatchRequest(seqs[i], 0, self.blocks[i], i) for i in range(B)], self.bs)
        with set_forward_context(pb.meta, self.caches):
            h = self.model(pb.input_ids, pb.meta.positions)
        h = h.view(B, L, -1)[torch.from_numpy(np.argsort(pb.order))]   # back to caller order
        return h, self.model.compute_logits(h.reshape(B * L, -1)).view(B, L, -1)


def init_head(cfg: ModelConfig, init: str, seed: int) -> MTPHead:
    torch.manual_seed(seed)
    head = MTPHead(cfg, torch.float32, attn_idx=0)
    ckpt = Checkpoint(cfg.path)
    if init == "mtp" and any(k.startswith("mtp.") for k in ckpt.keys()):
        load_weights(head, ckpt, head.weight_specs(), head.checkpoint_name, lambda k: False,
                     owned=lambda k: k.startswith("mtp."))
    else:
        with torch.no_grad():
            for n, p in head.named_parameters():
                if n.endswith("A_log") or "norm" in n:
                    p.zero_() if cfg.norm_zero_centered else p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)
    for p in head.parameters():
        p.requires_grad_(True)
    return head.train()


TOPK = 32   # teacher distributions are kept as their top-k (sparse distillation)


def teacher_targets(teacher: "Teacher", seqs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> hidden [B, L, H], top-k teacher log-probs [B, L, K] (renormalised) and their ids."""
    h, logits = teacher(seqs)
    lp = logits.float().log_softmax(-1)
    top_v, top_i = lp.topk(min(TOPK, lp.shape[-1]), dim=-1)
    return h, top_v.log_softmax(-1), top_i


def draft_logits(head: MTPHead, target, seqs: np.ndarray, h: torch.Tensor,
                 lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The training path's first drafts: the head at position i sees (embed(t_{i+1}), h_i) and
    its logits predict t_{i+2}. seqs [B, L], h [B, L, H] -> fp32 logits [B * (L - 1), V]
    (sequence-major). The serving proposer must give the same logits for the same inputs
    (tests/spec_decode/test_draft_parity.py)."""
    B, L = seqs.shape
    ids = torch.from_numpy(seqs)
    pos = torch.arange(L - 1)
    outs = [head(target.embed_tokens(ids[b, 1:]), h[b, :-1], pos, dense=True) for b in range(B)]
    return lm_head(torch.cat(outs)).float()


@torch.no_grad()
def chained_hidden(head: MTPHead, target, seqs: np.ndarray, h: torch.Tensor, frac: float, depth: int,
                   gen: torch.Generator) -> torch.Tensor:
    """The hidden inputs of drafts 2..k, EAGLE-style: in serving, draft j + 1 at position p + 1
    sees the head's own output at p instead of the target's h_{p+1}. A random `frac` of the
    positions get that (the head's output one position back, `depth` times chained); the rest
    keep the target's. h [B, L, H] -> [B, L, H]."""
    if frac <= 0 or depth <= 0:
        return h
    B, L = seqs.shape
    ids = torch.from_numpy(seqs)
    embeds = target.embed_tokens(ids[:, 1:])
    mask = (torch.rand(B, L - 1, 1, generator=gen) < frac)
    cur = h
    for _ in range(depth):
        own = torch.stack([head(embeds[b], cur[b, :-1], torch.arange(L - 1), dense=True) for b in range(B)])
        cur = torch.cat([h[:, :1], torch.where(mask, own.to(h.dtype), h[:, 1:])], 1)
    return cur


@dataclass(frozen=True)
class LossVocab:
    """The tokens the training loss normalises over: those of the training text and the
    teacher's top alternatives. A softmax over them, not the whole vocabulary, makes a step several
    times cheaper (the LM head dominates); serving still drafts over the whole vocabulary, and the
    held-out agreement is measured that way."""

    ids: torch.Tensor              # [V'] token ids, sorted
    index: torch.Tensor            # [V] position in ids, -1 for tokens outside
    weight: torch.Tensor           # [V', H] the LM head's rows

    @classmethod
    def build(cls, token_ids: list[torch.Tensor], lm_head_weight: torch.Tensor) -> "LossVocab":
        ids = torch.unique(torch.cat([t.reshape(-1) for t in token_ids]))
        index = torch.full((lm_head_weight.shape[0],), -1, dtype=torch.long)
        index[ids] = torch.arange(len(ids))
        return cls(ids, index, lm_head_weight[ids].detach())


def head_loss(head: MTPHead, target, seqs: np.ndarray, h: torch.Tensor, top_lp: torch.Tensor,
              top_ids: torch.Tensor, vocab: LossVocab | None = None) -> tuple[torch.Tensor, float]:
    """Cross-entropy of the head against the teacher's (top-k) distribution of the token after
    next, over every position with a teacher (over vocab's tokens only when given, the teacher's
    renormalised to them); and the top-1 agreement."""
    t_lp = top_lp[:, 1:].reshape(-1, top_lp.shape[-1])
    t_ids = top_ids[:, 1:].reshape(-1, top_ids.shape[-1])
    t_p = t_lp.exp()
    w = target.lm_head.weight if vocab is None else vocab.weight
    draft = draft_logits(head, target, seqs, h, lambda x: F.linear(x, w)).log_softmax(-1)
    if vocab is not None:
        t_ids_in = vocab.index[t_ids]
        t_p = t_p * (t_ids_in >= 0)
        t_p = t_p / t_p.sum(-1, keepdim=True).clamp(min=1e-9)
        loss = -(t_p * draft.gather(-1, t_ids_in.clamp(min=0))).sum(-1).mean()
        agree = (vocab.ids[draft.argmax(-1)] == t_ids[:, 0]).float().mean().item()
        return loss, agree
    loss = -(t_p * draft.gather(-1, t_ids)).sum(-1).mean()
    agree = (draft.argmax(-1) == t_ids[:, 0]).float().mean().item()
    return loss, agree


def _batches(ids: np.ndarray, seq_len: int, batch_size: int, rng: np.random.Generator):
    if len(ids) <= seq_len:
        raise ValueError(f"the training text has {len(ids)} tokens; need more than --seq-len={seq_len}")
    while True:
        starts = rng.integers(0, len(ids) - seq_len, batch_size)
        yield np.stack([ids[s:s + seq_len] for s in starts])


def self_generated_text(model_path: str, num: int, max_tokens: int, seed: int) -> str:
    """Text the target itself writes (sampled and greedy), from short random prompts: the
    distribution a draft head meets at serving time."""
    from backboard.engine.llm import LLM
    from backboard.sampling_params import SamplingParams

    llm = LLM(model_path, max_num_seqs=32, max_model_len=max_tokens + 64, seed=seed)
    rng = np.random.default_rng(seed)
    vocab = llm.get_tokenizer().vocab_size
    prompts = [rng.integers(0, vocab, int(rng.integers(4, 32))).tolist() for _ in range(num)]
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed + i,
                             temperature=0.0 if i % 2 else 1.0) for i in range(num)]
    outs = llm.generate(prompts, params)
    return "\n".join(o.outputs[0].text for o in outs)


def train_draft_head(model: str, text: str, out_dir: str, *, minutes: float = 3.0, steps: int | None = None,
                     seq_len: int = 128, batch_size: int = 8, lr: float = 2e-3, group_size: int = 64,
                     init: str = "mtp", seed: int = 0, pool_batches: int = 32, held_text: str | None = None,
                     chain_frac: float = 0.5, chain_depth: int = 2, loss_vocab_top: int = 0, log=print) -> dict:
    """Train, quantize, save; returns statistics (steps, loss, top-1 agreement of the float and
    the int4 head with the teacher on held-out text: held_text when given, which should come
    from other prompts; else the last tenth of text). chain_frac of the positions train the
    chained drafts (chained_hidden). loss_vocab_top > 0: the loss normalises over LossVocab (the
    text's tokens and the teacher's top loss_vocab_top alternatives)."""
    torch.manual_seed(seed)
    cfg = ModelConfig.from_pretrained(model, dtype="float32")
    tok = Tokenizer(model)
    ids = np.asarray(tok.encode(text), dtype=np.int64)
    if held_text:
        train_ids, held_ids = ids, np.asarray(tok.encode(held_text), dtype=np.int64)
    else:
        split = int(len(ids) * 0.9)
        train_ids, held_ids = ids[:split], ids[split:]
    if len(held_ids) <= seq_len:
        held_ids = ids[-(seq_len + 1):]
    gen = torch.Generator().manual_seed(seed)
    teacher = Teacher(cfg, batch_size, seq_len)
    target = teacher.model
    head = init_head(cfg, init, seed)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    # the teacher is frozen: its outputs for a pool of batches are computed once and reused
    pool = [next(_batches(train_ids, seq_len, batch_size, rng)) for _ in range(pool_batches)]
    cached = [(seqs, *teacher_targets(teacher, seqs)) for seqs in pool]
    vocab = LossVocab.build([torch.from_numpy(train_ids)] + [c[3][..., :loss_vocab_top] for c in cached],
                            target.lm_head.weight) if loss_vocab_top else None
    if vocab is not None:
        log(f"loss vocabulary: {len(vocab.ids)} tokens")
    t0 = time.time()
    step, loss_v, agree = 0, math.nan, 0.0
    total = steps if steps is not None else 10 ** 9
    while step < total and (steps is not None or time.time() - t0 < minutes * 60):
        seqs, h, top_lp, top_ids = cached[step % len(cached)]
        frac = step / total if steps is not None else (time.time() - t0) / (minutes * 60)
        for g in opt.param_groups:   # cosine decay over the step (or time) budget
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        h_in = chained_hidden(head, target, seqs, h, chain_frac, chain_depth, gen)
        loss, agree = head_loss(head, target, seqs, h_in, top_lp, top_ids, vocab)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        loss_v = loss.item()
        step += 1
        if step % 20 == 0:
            log(f"step {step}: loss {loss_v:.4f}, top-1 agreement {agree:.3f}")
    held = next(_batches(held_ids, seq_len, min(batch_size, 4), np.random.default_rng(seed + 1)))
    head.eval()
    with torch.no_grad():
        targets = teacher_targets(teacher, held)
        _, agree_fp = head_loss(head, target, held, *targets)
        groups = quantize_head(head, group_size)
        _, agree_q = head_loss(head, target, held, *targets)
        chained = chained_hidden(head, target, held, targets[0], 1.0, 1, gen)    # as draft 2 sees it
        _, agree_chain = head_loss(head, target, held, chained, *targets[1:])
    stats = {"steps": step, "train_seconds": round(time.time() - t0, 1), "final_loss": loss_v,
             "heldout_top1_agreement_float": agree_fp, "heldout_top1_agreement_int4": agree_q,
             "heldout_top1_agreement_int4_chained": agree_chain,
             "tokens": int(len(train_ids)), "loss_vocab": len(vocab.ids) if vocab is not None else None}
    save_draft_head(out_dir, head, groups, cfg, target.lm_head.weight, source="train", stats=stats)
    log(f"saved the int4 draft head to {out_dir}: {stats}")
    return stats


def quantize_mtp_head(model: str, out_dir: str, group_size: int = 64) -> dict:
    """`backboard draft quantize`: the checkpoint's own MTP head in the draft-head format."""
    cfg = ModelConfig.from_pretrained(model, dtype="float32")
    head = init_head(cfg, "mtp", 0).eval()
    if not any(k.startswith("mtp.") for k in Checkpoint(cfg.path).keys()):
        raise ValueError(f"{model} has no MTP head (mtp.*) to quantize; train one with `backboard draft train`")
    target = load_model(cfg)
    groups = quantize_head(head, group_size)
    save_draft_head(out_dir, head, groups, cfg, target.lm_head.weight, source="mtp")
    return {"group_sizes": groups}
