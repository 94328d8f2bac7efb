"""Draft-head training: distil an MTP-structured head from the target, then quantize it to 4 bits.

The teacher is the target itself: for a sequence t_0..t_{L-1} its final-normed hidden states h_i
and next-token distributions p_i. The head at position i sees (embed(t_{i+1}), h_i) and is trained
to match p_{i+1} (the distribution of t_{i+2}): the cross-entropy of the head against p_{i+1}
restricted to its top-k tokens (sparse distillation; KL up to a constant), counted only where
t_{i+2} is a token serving drafts (an answer token of a chat corpus, spec_decode/corpus.py; every
token of plain text). Only the head learns; the embedding and LM head stay the target's. The
teacher is frozen, so its outputs for the whole corpus are computed once (TeacherCache)."""

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
from backboard.spec_decode.corpus import TokenCorpus
from backboard.spec_decode.draft_head import (
    fake_quantize_head,
    quantize_head,
    read_draft_config,
    read_draft_head,
    save_draft_head,
    set_draft_vocab,
    widen_head,
)
from backboard.spec_decode.draft_vocab import coverage, draft_vocab_for
from backboard.worker.input_batch import BatchRequest, prepare_batch
from backboard.worker.memory import allocate_caches

logger = logging.getLogger(__name__)


class Teacher:
    """The target over flat batches of whole sequences: hidden states and logits of every row."""

    def __init__(self, cfg: ModelConfig, batch_size: int, seq_len: int, block_size: int = 16) -> None:
        self.model = load_model(cfg)
        self.bs = block_size
        per = -(-seq_len // block_size)
        self.caches = allocate_caches(cfg, per * batch_size, block_size, batch_size, getattr(torch, cfg.dtype))
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
    """A float32 head to train. init: "mtp" (the checkpoint's MTP head when it has one, else
    random), "random", or a saved draft head's folder (its int4 weights dequantized: training
    goes on from there)."""
    torch.manual_seed(seed)
    if init not in ("mtp", "random"):
        head, _ = read_draft_head(init, cfg, torch.float32, attn_idx=0)
        widen_head(head, torch.float32)
        return _trainable(head)
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
    return _trainable(head)


def _trainable(head: MTPHead) -> MTPHead:
    for p in head.parameters():
        p.requires_grad_(True)
    return head.train()


TOPK = 16   # teacher distributions are kept as their top-k (sparse distillation)


def teacher_targets(teacher: "Teacher", seqs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> hidden [B, L, H], top-k teacher log-probs [B, L, K] (renormalised) and their ids."""
    h, logits = teacher(seqs)
    lp = logits.float().log_softmax(-1)
    top_v, top_i = lp.topk(min(TOPK, lp.shape[-1]), dim=-1)
    return h, top_v.log_softmax(-1), top_i


def head_outputs(head: MTPHead, target, seqs: np.ndarray, h: torch.Tensor) -> torch.Tensor:
    """The head at position i sees (embed(t_{i+1}), h_i); seqs [B, L], h [B, L, H] -> its normed
    hidden states [B, L - 1, H] (their logits predict t_{i+2})."""
    B, L = seqs.shape
    ids = torch.from_numpy(seqs)
    pos = torch.arange(L - 1)
    return torch.stack([head(target.embed_tokens(ids[b, 1:]), h[b, :-1], pos, dense=True) for b in range(B)])


def draft_logits(head: MTPHead, target, seqs: np.ndarray, h: torch.Tensor,
                 lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The training path's first drafts: seqs [B, L], h [B, L, H] -> fp32 logits [B * (L - 1), V]
    (sequence-major) of t_{i+2}. The serving proposer must give the same logits for the same
    inputs (tests/spec_decode/test_draft_parity.py)."""
    out = head_outputs(head, target, seqs, h)
    return lm_head(out.reshape(-1, out.shape[-1])).float()


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
              top_ids: torch.Tensor, vocab: LossVocab | None = None, weight: torch.Tensor | None = None,
              feat: tuple[float, torch.Tensor] | None = None) -> tuple[torch.Tensor, float]:
    """Cross-entropy of the head against the teacher's (top-k) distribution of the token after
    next (over vocab's tokens only when given, the teacher's renormalised to them), averaged over
    the positions with weight [B, L - 1] (1 where that token is one serving drafts, an answer
    token; every position when None); and the weighted top-1 agreement. feat = (w, teacher hidden
    [B, L, H]) adds w times EAGLE's feature regression (smooth L1 of the head's output at i
    against the target's h_{i+1}, the hidden state the next draft would see)."""
    t_lp = top_lp[:, 1:].reshape(-1, top_lp.shape[-1])
    t_ids = top_ids[:, 1:].reshape(-1, top_ids.shape[-1])
    t_p = t_lp.exp()
    wt = torch.ones(t_ids.shape[0]) if weight is None else weight.reshape(-1).float()
    norm = wt.sum().clamp(min=1.0)
    w = (target.lm_head.weight if vocab is None else vocab.weight).float()
    out = head_outputs(head, target, seqs, h)
    draft = F.linear(out.reshape(-1, out.shape[-1]), w).float().log_softmax(-1)
    if vocab is not None:
        t_ids_in = vocab.index[t_ids]
        t_p = t_p * (t_ids_in >= 0)
        t_p = t_p / t_p.sum(-1, keepdim=True).clamp(min=1e-9)
        ce = -(t_p * draft.gather(-1, t_ids_in.clamp(min=0))).sum(-1)
        pred = vocab.ids[draft.argmax(-1)]
    else:
        ce = -(t_p * draft.gather(-1, t_ids)).sum(-1)
        pred = draft.argmax(-1)
    loss = (ce * wt).sum() / norm
    if feat is not None and feat[0] > 0:
        reg = F.smooth_l1_loss(out, feat[1][:, 1:].to(out.dtype), reduction="none").mean(-1)
        loss = loss + feat[0] * (reg.reshape(-1) * wt).sum() / norm
    agree = (((pred == t_ids[:, 0]).float() * wt).sum() / norm).item()
    return loss, agree


def windows(corpus: TokenCorpus, seq_len: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The corpus tiled into windows of seq_len tokens from `offset`, those where the head has an
    answer token to predict: -> ids [W, L], weight [W, L - 1] (1 where the head's target t_{i+2}
    is an answer token)."""
    n = (len(corpus) - offset - 1) // seq_len
    if n < 1:
        raise ValueError(f"the training text has {len(corpus)} tokens; need more than --seq-len={seq_len}")
    starts = offset + seq_len * np.arange(n)
    ids = np.stack([corpus.ids[s:s + seq_len] for s in starts])
    weight = np.stack([corpus.answer[s + 2:s + seq_len + 1] for s in starts]).astype(np.float32)
    keep = weight.sum(1) > 0
    return ids[keep], weight[keep]


@dataclass
class TeacherCache:
    """The frozen teacher's outputs for every window, computed once (hidden states kept in bf16,
    log-probs in fp16 to fit hundreds of thousands of tokens)."""

    seqs: np.ndarray          # [W, L]
    weight: torch.Tensor      # [W, L - 1]
    hidden: torch.Tensor      # [W, L, H] bf16
    top_lp: torch.Tensor      # [W, L, K] fp16
    top_ids: torch.Tensor     # [W, L, K] int32

    @classmethod
    def build(cls, teacher: Teacher, seqs: np.ndarray, weight: np.ndarray, batch_size: int,
              log=print) -> "TeacherCache":
        parts, t0 = [], time.time()
        for b0 in range(0, len(seqs), batch_size):
            h, lp, ids = teacher_targets(teacher, seqs[b0:b0 + batch_size])
            parts.append((h.to(torch.bfloat16), lp.half(), ids.int()))
            if (b0 // batch_size) % 50 == 49:
                log(f"teacher: {b0 + batch_size}/{len(seqs)} windows, {time.time() - t0:.0f} s")
        return cls(seqs, torch.from_numpy(weight), *(torch.cat([p[i] for p in parts]) for i in range(3)))

    def __len__(self) -> int:
        return len(self.seqs)

    def batch(self, idx: np.ndarray) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> seqs, hidden (fp32), top log-probs (fp32), top ids (int64), weight."""
        i = torch.from_numpy(idx)
        return (self.seqs[idx], self.hidden[i].float(), self.top_lp[i].float(), self.top_ids[i].long(),
                self.weight[i])


def _as_corpus(data: "str | TokenCorpus", tok: Tokenizer) -> TokenCorpus:
    return data if isinstance(data, TokenCorpus) else TokenCorpus.from_text(tok.encode(data))


def _lr_at(lr: float, frac: float, step: int, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay over the budget (frac in [0, 1])."""
    return lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


@torch.no_grad()
def heldout_agreement(head: MTPHead, target, held: TeacherCache, batch_size: int,
                      chained: torch.Generator | None = None) -> float:
    """Top-1 agreement of the head's first drafts (whole vocabulary) with the teacher on the
    held-out windows' answer tokens; with `chained`, as draft 2 sees it (the head's own hidden)."""
    hits = total = 0.0
    for b0 in range(0, len(held), batch_size):
        seqs, h, lp, ids, w = held.batch(np.arange(b0, min(b0 + batch_size, len(held))))
        if chained is not None:
            h = chained_hidden(head, target, seqs, h, 1.0, 1, chained)
        _, a = head_loss(head, target, seqs, h, lp, ids, weight=w)
        hits, total = hits + a * float(w.sum()), total + float(w.sum())
    return hits / max(total, 1.0)


def self_generated_text(model_path: str, num: int, max_tokens: int, seed: int) -> str:
    """Text the target itself writes (sampled and greedy), from short random prompts: the
    distribution a draft head meets at serving time (for models without a chat template)."""
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


def _split(corpus: TokenCorpus, held: "str | TokenCorpus | None", tok: Tokenizer) -> tuple[TokenCorpus, TokenCorpus]:
    if held is not None:
        return corpus, _as_corpus(held, tok)
    cut = int(len(corpus) * 0.9)
    return (TokenCorpus(corpus.ids[:cut], corpus.answer[:cut], corpus.starts[corpus.starts < cut]),
            TokenCorpus(corpus.ids[cut:], corpus.answer[cut:], np.zeros(1, np.int64)))


def train_draft_head(model: str, text: "str | TokenCorpus", out_dir: str, *, minutes: float = 3.0,
                     steps: int | None = None, seq_len: int = 128, batch_size: int = 8, lr: float = 2e-3,
                     group_size: int = 64, init: str = "mtp", seed: int = 0, max_windows: int | None = None,
                     held_text: "str | TokenCorpus | None" = None, held_windows: int = 16, chain_frac: float = 0.5,
                     chain_depth: int = 2, loss_vocab_top: int = 0, feat_weight: float = 0.0, warmup: int = 20,
                     teacher_dtype: str = "float32", qat_frac: float = 0.0, draft_vocab: "str | int" = "auto",
                     log=print) -> dict:
    """Train, quantize, save; returns statistics (steps, tokens, loss, top-1 agreement of the
    float and the int4 head with the teacher on the answer tokens of held-out text: held_text
    when given, which should come from other prompts; else the last tenth of text). text: plain
    text (every token trained) or a TokenCorpus (the loss counts answer tokens only). The teacher's
    outputs for the whole corpus (at most max_windows windows) are computed once; each step trains
    on batch_size windows of seq_len tokens, epochs in a fresh random order. chain_frac of the
    positions train the chained drafts (chained_hidden). loss_vocab_top > 0: the loss normalises
    over LossVocab (the text's tokens and the teacher's top loss_vocab_top alternatives).
    feat_weight > 0: EAGLE's feature regression beside the token loss (head_loss). qat_frac > 0:
    the last qat_frac of the budget trains through the int4 values (fake_quantize_head), so the
    saved 4-bit head is the one that was trained. draft_vocab: the INT8 LM head's tokens
    (spec_decode/draft_vocab.draft_vocab_for over the training answer tokens)."""
    torch.manual_seed(seed)
    cfg = ModelConfig.from_pretrained(model, dtype="float32")
    head = init_head(cfg, init, seed)   # first: a bad --init folder stops before the teacher's pass
    tok = Tokenizer(model)
    train, held = _split(_as_corpus(text, tok), held_text, tok)
    rng = np.random.default_rng(seed)
    seqs, weight = windows(train, seq_len, int(rng.integers(seq_len)))
    if max_windows is not None and len(seqs) > max_windows:
        pick = np.sort(rng.choice(len(seqs), max_windows, replace=False))
        seqs, weight = seqs[pick], weight[pick]
    held_seqs, held_weight = windows(held, min(seq_len, len(held) - 1))
    gen = torch.Generator().manual_seed(seed)
    teacher = Teacher(ModelConfig.from_pretrained(model, dtype=teacher_dtype), batch_size, seq_len)
    target = teacher.model
    t_build = time.time()
    cache = TeacherCache.build(teacher, seqs, weight, batch_size, log)
    held_cache = TeacherCache.build(teacher, held_seqs[:held_windows], held_weight[:held_windows], batch_size, log)
    log(f"teacher outputs for {len(cache)} windows ({cache.seqs.size} tokens) in {time.time() - t_build:.0f} s")
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    lm_w = target.lm_head.weight.float()
    vocab = LossVocab.build([torch.from_numpy(seqs), cache.top_ids[..., :loss_vocab_top]],
                            lm_w) if loss_vocab_top else None
    if vocab is not None:
        log(f"loss vocabulary: {len(vocab.ids)} tokens")
    t0 = time.time()
    step, loss_v, agree, order = 0, math.nan, 0.0, np.zeros(0, np.int64)
    total = steps if steps is not None else 10 ** 9
    while step < total and (steps is not None or time.time() - t0 < minutes * 60):
        if len(order) < batch_size:
            order = np.r_[order, rng.permutation(len(cache))]
        idx, order = order[:batch_size], order[batch_size:]
        seqs_b, h, top_lp, top_ids, w = cache.batch(idx)
        frac = step / total if steps is not None else (time.time() - t0) / (minutes * 60)
        if qat_frac > 0 and frac >= 1.0 - qat_frac:
            fake_quantize_head(head, group_size)
        for g in opt.param_groups:
            g["lr"] = _lr_at(lr, frac, step, warmup)
        h_in = chained_hidden(head, target, seqs_b, h, chain_frac, chain_depth, gen)
        loss, agree = head_loss(head, target, seqs_b, h_in, top_lp, top_ids, vocab, w, (feat_weight, h))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        loss_v = loss.item()
        step += 1
        if step % 20 == 0:
            log(f"step {step} ({time.time() - t0:.0f} s): loss {loss_v:.4f}, top-1 agreement {agree:.3f}")
        if step % 200 == 0:
            agree_held = heldout_agreement(head.eval(), target, held_cache, batch_size)
            log(f"step {step}: held-out answer agreement {agree_held:.3f}")
            head.train()
    head.eval()
    fake_quantize_head(head, group_size, on=False)
    agree_fp = heldout_agreement(head, target, held_cache, batch_size)
    groups = quantize_head(head, group_size)
    agree_q = heldout_agreement(head, target, held_cache, batch_size)
    agree_chain = heldout_agreement(head, target, held_cache, batch_size, chained=gen)
    stats = {"steps": step, "train_seconds": round(time.time() - t0, 1), "final_loss": loss_v,
             "heldout_top1_agreement_float": agree_fp, "heldout_top1_agreement_int4": agree_q,
             "heldout_top1_agreement_int4_chained": agree_chain, "heldout_answer_tokens": int(held_cache.weight.sum()),
             "tokens": int(len(train)), "answer_tokens": int(train.answer.sum()),
             "trained_positions": step * batch_size * (seq_len - 1),
             "loss_vocab": len(vocab.ids) if vocab is not None else None, "qat_frac": qat_frac}
    vocab_ids = draft_vocab_for(train.answer_ids(), cfg.vocab_size, draft_vocab)
    stats.update(vocab_stats(vocab_ids, held))
    save_draft_head(out_dir, head, groups, cfg, target.lm_head.weight.float(), source="train", stats=stats,
                    draft_vocab=vocab_ids)
    log(f"saved the int4 draft head to {out_dir}: {stats}")
    return stats


def vocab_stats(vocab_ids: np.ndarray | None, held: TokenCorpus) -> dict:
    """The draft vocabulary's size and its coverage of the held-out answer tokens."""
    if vocab_ids is None:
        return {"draft_vocab_size": None}
    return {"draft_vocab_size": len(vocab_ids),
            "draft_vocab_heldout_cover": coverage(vocab_ids, held.answer_ids())}


def set_vocab_from_corpus(model: str, head_dir: str, train: TokenCorpus, held: TokenCorpus,
                          spec: "str | int") -> dict:
    """`backboard draft vocab`: a saved head's INT8 LM head over the draft vocabulary of train's
    answer tokens (draft_vocab_for), from the target's LM head. -> the vocabulary's statistics."""
    cfg = ModelConfig.from_pretrained(model, dtype="float32")
    read_draft_config(head_dir, cfg)                       # a folder for this model, before the work
    ids = draft_vocab_for(train.answer_ids(), cfg.vocab_size, spec)
    stats = vocab_stats(ids, held)
    set_draft_vocab(head_dir, load_model(cfg).lm_head.weight, ids, stats)
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
