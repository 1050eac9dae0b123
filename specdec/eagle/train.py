"""Training the draft head: target features, the unrolled loss, offline acceptance, checkpoints.

The target (a Hugging Face causal LM on the engine's weights, frozen) gives each sequence's hidden states
at the head's three feature layers; the head is trained with EAGLE-3's training-time test (`depth`
unrolled draft steps, step i weighted 0.8^i) on the target's own greedy responses, so the labels are the
target's argmax. Loss counts only response tokens. Offline acceptance on held-out sequences: at each
response position, 1 + the number of leading unrolled steps whose argmax is the next token; for greedy
data that is what greedy verification with K = depth would accept.
Checkpoints (`ckpt.pt`: head, optimizer, step) are written every `ckpt_every` steps and on exit; a run
finds its checkpoint and resumes.
"""
from __future__ import annotations

import os
import random
import time

import torch
import torch.nn.functional as F

from engine.speculative.eagle_head import EagleHead, unrolled_logits


class Target:
    """Frozen target pieces the head needs: features at its layers, embedding, final norm, LM head."""

    def __init__(self, model, layers: tuple[int, int, int]):
        self.model = model.eval().requires_grad_(False)
        self.layers = layers
        dtype = next(model.parameters()).dtype
        self.embed = model.get_input_embeddings()
        # the head may run in another dtype than the target: cast into the target's pieces
        self.final_norm = lambda x: model.model.norm(x.to(dtype))
        self.lm_head = model.get_output_embeddings()

    @torch.no_grad()
    def features(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True)
        return torch.cat([out.hidden_states[i + 1] for i in self.layers], dim=-1)


def make_batch(seqs, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T], attention mask, and response mask (positions whose token is an output)."""
    t = max(len(ids) for ids, _ in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    attn = torch.zeros(len(seqs), t, dtype=torch.long)
    resp = torch.zeros(len(seqs), t, dtype=torch.bool)
    for r, (s, p) in enumerate(seqs):
        ids[r, :len(s)] = torch.tensor(s)
        attn[r, :len(s)] = 1
        resp[r, p:len(s)] = True
    return ids.to(device), attn.to(device), resp.to(device)


def step_outputs(head: EagleHead, target: Target, ids, attn, resp, depth: int):
    """(loss, accepted counts per step-0 position [B, T] (-1 where not scored)) of one batch. Logits are
    computed only where some step has a label (a response token 2 + i ahead)."""
    feats = target.features(ids, attn)
    b, t = ids.shape
    labels, valid = [], []
    for i in range(depth):
        shift = 2 + i                                   # step i at position t predicts token t + 2 + i
        lab = torch.full_like(ids, -100)
        lab[:, :t - shift] = ids[:, shift:]
        ok = torch.zeros_like(resp)
        ok[:, :t - shift] = resp[:, shift:]
        labels.append(lab.masked_fill(~ok, -100))
        valid.append(ok)
    select = torch.stack(valid).any(0)
    logits = unrolled_logits(head, feats.to(head.fc.weight.dtype), target.embed, ids, target.final_norm,
                             target.lm_head, depth, select=select)
    loss, run = 0.0, torch.ones(int(select.sum()), dtype=torch.bool, device=ids.device)
    accepted = torch.zeros_like(run, dtype=torch.long)
    for i, lg in enumerate(logits):
        lab, ok = labels[i][select], valid[i][select]
        ce = F.cross_entropy(lg.float(), lab, ignore_index=-100, reduction="sum")
        loss = loss + (0.8 ** i) * ce / ok.sum().clamp(min=1)
        run = run & (lg.argmax(-1) == lab) & ok
        accepted += run
    out = torch.full_like(ids, -1)
    out[select] = torch.where(valid[0][select], accepted, -1)   # scored: step 0 has a label there
    return loss, out


def acceptance_length(accepted: torch.Tensor) -> float:
    scored = accepted[accepted >= 0]
    return 1.0 + scored.float().mean().item() if scored.numel() else 0.0


def train(head: EagleHead, target: Target, seqs, held_out, *, out_dir: str, steps: int, batch: int, lr: float,
          depth: int, ckpt_every: int = 200, time_limit_s: float | None = None, seed: int = 0, decay: str = "time",
          bucket: int = 1, log=print) -> dict:
    """Train (resuming from out_dir/ckpt.pt if there) until `steps` or `time_limit_s`. Returns a summary.
    decay "time": the learning rate decays linearly over the planned steps or over this call's time limit,
    whichever ends first (a resumed call starts high again); "steps": over the planned steps only, so a run
    split over calls follows one schedule. bucket: see pick_batch."""
    if decay not in ("time", "steps"):
        raise ValueError(f"decay must be 'time' or 'steps', got {decay!r}")
    device = head.fc.weight.device
    torch.backends.cuda.matmul.allow_tf32 = True       # the head trains in float32: TF32 matmuls on CUDA
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt = os.path.join(out_dir, "ckpt.pt")
    start, losses, t0 = 0, [], time.monotonic()
    if os.path.exists(ckpt):
        state = torch.load(ckpt, map_location=device)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        start, losses = state["step"], state["losses"]
        log(f"train: resuming at step {start}")
    rng = random.Random(seed)
    step = start
    for step in range(start, steps):
        rng.seed(seed * 1_000_003 + step)              # the batch of a step is the same after a resume
        lr_now = learning_rate(lr, step, steps, time.monotonic() - t0, time_limit_s, decay)
        for g in opt.param_groups:
            g["lr"] = lr_now
        loss, _ = step_outputs(head, target, *make_batch(pick_batch(rng, seqs, batch, bucket), device), depth)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        losses.append(round(loss.item(), 4))
        if (step + 1) % 20 == 0:
            log(f"train: step {step + 1}/{steps} loss {sum(losses[-20:]) / 20:.3f} ({time.monotonic() - t0:.0f} s)")
        out_of_time = time_limit_s is not None and time.monotonic() - t0 > time_limit_s
        if (step + 1) % ckpt_every == 0 or out_of_time:
            save_checkpoint(ckpt, head, opt, step + 1, losses)
            if out_of_time:
                log(f"train: time limit at step {step + 1}; resume to go on")
                return dict(step=step + 1, done=False, losses=losses)
    save_checkpoint(ckpt, head, opt, steps, losses)
    return dict(step=steps, done=True, losses=losses, held_out_acceptance=evaluate(head, target, held_out, depth))


def learning_rate(peak: float, step: int, steps: int, elapsed_s: float, time_limit_s: float | None,
                  decay: str = "time") -> float:
    """Warm-up over the first 50 steps, then linear decay to a tenth of `peak`: over the planned steps, or (decay
    "time") over this call's time limit if that ends first."""
    by_time = elapsed_s / time_limit_s if time_limit_s and decay == "time" else 0.0
    done = max(step / steps, by_time)
    return peak * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * max(0.0, 1 - done))


def pick_batch(rng: random.Random, seqs, batch: int, bucket: int = 1) -> list:
    """`batch` sequences drawn at random. With bucket B > 1, B batches' worth are drawn, sorted by length and
    one batch of neighbours is kept: less padding (a batch is as long as its longest sequence) for the same
    draws on average. The draw depends only on `rng`, so a resumed step gets the same batch."""
    if bucket < 1:
        raise ValueError(f"bucket must be >= 1, got {bucket}")
    pool = rng.sample(seqs, min(batch * bucket, len(seqs)))
    if bucket == 1:
        return pool
    pool.sort(key=lambda s: len(s[0]))
    i = rng.randrange(max(1, len(pool) // batch))
    return pool[i * batch:(i + 1) * batch]


def save_checkpoint(path: str, head, opt, step: int, losses: list) -> None:
    tmp = path + ".tmp"
    torch.save(dict(head=head.state_dict(), opt=opt.state_dict(), step=step, losses=losses), tmp)
    os.replace(tmp, path)


@torch.no_grad()
def evaluate(head: EagleHead, target: Target, seqs, depth: int, batch: int = 8) -> float:
    """Offline acceptance length (greedy, K = depth) over held-out sequences."""
    device = head.fc.weight.device
    counts = []
    for i in range(0, len(seqs), batch):
        _, acc = step_outputs(head, target, *make_batch(seqs[i:i + batch], device), depth)
        counts.append(acc[acc >= 0])
    return acceptance_length(torch.cat(counts)) if counts else 0.0
