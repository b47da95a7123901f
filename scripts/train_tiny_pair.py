#!/usr/bin/env python
"""Train the tiny byte-level Llama target/draft pair shipped in ``kvmulti/models/tiny/``.

Data: the ``.py`` sources of the Python standard library of the running interpreter
(``sysconfig.get_paths()['stdlib']``, without site-packages and test directories), read as raw
bytes -- nothing is downloaded. One file in 20 (sorted by path) is held out for evaluation.

Vocabulary (shared by both models): ids 0..255 are the bytes themselves, BOS=256, EOS=257,
PAD=258 (vocab_size 259). Every file is encoded as BOS + its UTF-8 bytes + EOS; prompts should be
encoded the same way (BOS + bytes).

Models (HF ``LlamaForCausalLM``, tied embeddings, head_dim 64, rope_theta 10000):
  target: 8 layers, hidden 256, 4 query heads / 2 KV heads (GQA), MLP 384  -> ~4.0 M parameters
  draft : 1 layer,  hidden 256, 4 query heads / 2 KV heads,       MLP 384  -> ~0.56 M parameters
Training: AdamW, warmup + cosine, batch 8 x 512 bytes. The target learns next-byte cross-entropy;
the draft is distilled from it (KL(target || draft) on the detached target logits) at every target
step, then for ``--draft-steps`` more steps against the frozen final target. Weights are saved in
float16 (~9 MB in all) and the saved pair is reloaded to measure held-out loss and the greedy
acceptance of the draft against the target (k = 4 speculative steps along the target's greedy text).

Time (defaults, torch threads = 2, seed 0): ~1.05 s per target step on 2 idle cores, i.e. about
12 minutes in all; the shipped pair took 19 minutes on the shared (busy) machine. Result of that run:
held-out 2.06 bits/byte (target) / 2.80 (draft), draft/target greedy agreement 0.85, k = 4 greedy
acceptance 0.67 (3.55 tokens per target step). More --target-steps give a better target.
Usage: .venv/bin/python scripts/train_tiny_pair.py [--target-steps 600] [--draft-steps 150]
                                                   [--out kvmulti/models/tiny] [--resume]
``--resume`` loads the pair from --out and only distils the draft further against the frozen target.
"""
import argparse
import json
import math
import os
import sysconfig
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

BOS, EOS, PAD, VOCAB = 256, 257, 258, 259


def load_corpus():
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "test", "tests", "idle_test", "__pycache__"))
        paths += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    paths.sort()
    train, held = [], []
    for i, p in enumerate(paths):
        with open(p, "rb") as fh:
            ids = [BOS] + list(fh.read()) + [EOS]
        (held if i % 20 == 0 else train).append(torch.tensor(ids, dtype=torch.int16))
    return torch.cat(train), torch.cat(held), held


def make_config(layers, hidden, heads, kv_heads, mlp, max_pos):
    return LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=mlp,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=64, max_position_embeddings=max_pos, rope_theta=10000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=True, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)


def batch(data, bsz, seq, gen):
    starts = torch.randint(0, data.numel() - seq - 1, (bsz,), generator=gen)
    x = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()
    return x[:, :-1], x[:, 1:]


def lr_at(step, total, base, warmup=50):
    if step < warmup:
        return base * (step + 1) / warmup
    return base * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


def kl(draft_logits, target_logits):
    d = F.log_softmax(draft_logits.float().flatten(0, 1), -1)
    t = F.log_softmax(target_logits.float().flatten(0, 1), -1)
    return F.kl_div(d, t, log_target=True, reduction="batchmean")


@torch.no_grad()
def eval_loss(model, batches):
    model.eval()
    loss = sum(F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()).item() for x, y in batches)
    model.train()
    return loss / len(batches) / math.log(2)  # bits per byte


def save(model, path):
    model.to(torch.float16).save_pretrained(path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    # Flat copies of the fields older loaders (and kvmulti's own) read directly.
    cfg.update(rope_theta=10000.0, torch_dtype="float16",
               kvmulti_vocab={"type": "bytes", "bytes": "0-255", "bos": BOS, "eos": EOS, "pad": PAD})
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh, indent=2, sort_keys=True)
        fh.write("\n")


@torch.no_grad()
def greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=EOS,
                         pad_token_id=PAD, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0].tolist()


@torch.no_grad()
def acceptance(target, draft, prompts, n_new, k):
    """Greedy speculative decoding along the target's greedy text: per-token agreement of the
    draft's argmax with the target's, and the k-step acceptance rate / tokens per target step."""
    agree = total = accepted = proposed = steps = emitted = 0
    for p in prompts:
        seq = greedy(target, p, n_new)
        gen = seq[len(p):]
        d_arg = draft(input_ids=torch.tensor([seq])).logits[0].argmax(-1).tolist()
        match = [d_arg[len(p) - 1 + j] == gen[j] for j in range(len(gen))]
        agree, total = agree + sum(match), total + len(match)
        i = 0
        while i < len(match):
            window = match[i:i + k]
            acc = next((j for j, m in enumerate(window) if not m), len(window))
            proposed, accepted, steps = proposed + len(window), accepted + acc, steps + 1
            emitted += min(acc + 1, len(match) - i)
            i += acc + 1
    return agree / total, accepted / proposed, emitted / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "kvmulti", "models", "tiny"))
    ap.add_argument("--target-steps", type=int, default=600)
    ap.add_argument("--draft-steps", type=int, default=150, help="extra draft-only distillation steps")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--target-layers", type=int, default=8)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--draft-hidden", type=int, default=256)
    ap.add_argument("--mlp", type=int, default=384)
    ap.add_argument("--max-pos", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true",
                    help="load the pair from --out and only distil the draft further (--draft-steps) against "
                         "the frozen target; the target is left as it is")
    args = ap.parse_args()
    if args.resume:
        args.target_steps = 0
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # tiny softmax probabilities must not hit slow denormal arithmetic
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.time()

    train, held, held_docs = load_corpus()
    print(f"corpus: {train.numel() / 1e6:.1f} M train bytes, {held.numel() / 1e6:.2f} M held-out bytes")
    eval_batches = [batch(held, 8, args.seq, torch.Generator().manual_seed(1000 + i)) for i in range(4)]
    paths = {name: os.path.abspath(os.path.join(args.out, name)) for name in ("target", "draft")}
    if args.resume:
        target, draft = (LlamaForCausalLM.from_pretrained(paths[n], dtype=torch.float32) for n in ("target", "draft"))
    else:
        target = LlamaForCausalLM(make_config(args.target_layers, args.hidden, args.hidden // 64,
                                              max(1, args.hidden // 128), args.mlp, args.max_pos))
        draft = LlamaForCausalLM(make_config(args.draft_layers, args.draft_hidden, args.draft_hidden // 64,
                                             max(1, args.draft_hidden // 128), args.mlp, args.max_pos))
    n_t, n_d = (sum(p.numel() for p in m.parameters()) for m in (target, draft))
    print(f"params: target {n_t / 1e6:.2f} M, draft {n_d / 1e6:.2f} M")
    opt_t = torch.optim.AdamW(target.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    opt_d = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    d_total = args.target_steps + args.draft_steps

    for step in range(d_total):
        x, y = batch(train, args.batch, args.seq, gen)
        if step < args.target_steps:  # target CE step; its logits also teach the draft
            for g in opt_t.param_groups:
                g["lr"] = lr_at(step, args.target_steps, args.lr)
            t_logits = target(input_ids=x).logits
            loss_t = F.cross_entropy(t_logits.flatten(0, 1), y.flatten())
            loss_t.backward()
            torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
            opt_t.step()
            opt_t.zero_grad(set_to_none=True)
            t_logits = t_logits.detach()
        else:
            if step == args.target_steps:
                target.eval()
            with torch.no_grad():
                t_logits = target(input_ids=x).logits
            loss_t = None
        for g in opt_d.param_groups:
            g["lr"] = lr_at(step, d_total, args.lr)
        loss_d = kl(draft(input_ids=x).logits, t_logits)
        loss_d.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt_d.step()
        opt_d.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == d_total - 1:
            lt = f"target CE {loss_t.item() / math.log(2):.3f} bits/byte" if loss_t is not None else "target frozen"
            print(f"step {step:5d}  {lt}  draft KL {loss_d.item():.3f}  [{time.time() - t0:.0f}s]", flush=True)
    train_s = time.time() - t0

    if not args.resume:
        save(target, paths["target"])
    save(draft, paths["draft"])
    # Everything below uses the saved float16 weights, reloaded in float32 as kvmulti runs them.
    target = LlamaForCausalLM.from_pretrained(paths["target"], dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(paths["draft"], dtype=torch.float32).eval()
    print(f"training time {train_s:.0f}s")
    for name, m in (("target", target), ("draft", draft)):
        size = os.path.getsize(os.path.join(paths[name], "model.safetensors"))
        print(f"{name}: {eval_loss(m, eval_batches):.3f} held-out bits/byte, {size / 1e6:.2f} MB, {paths[name]}")

    pg = torch.Generator().manual_seed(7)
    prompts = [[BOS] + list(b"def fib(n):")]
    for doc in held_docs[:40:2]:
        s = torch.randint(1, max(2, doc.numel() - 200), (1,), generator=pg).item()
        prompts.append([BOS] + doc[s:s + 96].tolist())
    agree, acc, per_step = acceptance(target, draft, prompts, 64, 4)
    print(f"greedy agreement (draft argmax == target argmax along target text): {agree:.3f}")
    print(f"k=4 greedy acceptance rate {acc:.3f}, mean tokens per target step {per_step:.2f}")
    for name, m in (("target", target), ("draft", draft)):
        text = bytes(t for t in greedy(m, prompts[0], 160)[1:] if t < 256).decode("utf-8", "replace")
        print(f"--- {name} greedy from 'def fib(n):' ---\n{text}\n---")


if __name__ == "__main__":
    main()
