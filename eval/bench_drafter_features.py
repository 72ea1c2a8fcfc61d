"""Which target states should the feature drafter read: the last layer's alone, or EAGLE-3's fused low, middle
and high layers beside it? One side-by-side fine-tune answers it on this machine.

    python eval/bench_drafter_features.py --train-seqs 600 --out eval/results/drafter_features_amx_xeon

Both variants start from the same saved drafter (--drafter) and take the same optimizer steps over the same
sequences in the same order (one pass, batch 4, the drafter's own loss: smooth L1 on the next state plus 0.1 x
the cross-entropy against the target's distribution):
    last    the drafter as decoding runs it: it reads the target's final state f_t
    fused   it reads fc([g_a, g_b, g_c, f_t]): the target's residual stream entering layers a, b, c (RMS-scaled, as
            EAGLE-3's low, middle and high), with fc a new linear 4H -> H that starts as [0 0 0 I], so the
            variant starts where `last` does and can only add what those layers carry
Dev top-1 (the drafter's argmax is the target's) and acceptance (the sum of min(p, q)) of the first drafted step
before and after, on the dev sequences of the states folder. The target's states are computed once
(<cache>/<out's name>/features.pt, written atomically) and each finished variant is a line of results.jsonl: a
rerun resumes."""
from __future__ import annotations

import argparse
import copy
import io
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from adaptive_spec.errors import UserError, run_main
from adaptive_spec.runs import append_jsonl, atomic_write, read_jsonl
from adaptive_spec.tables import md_table


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--states", default="runs/drafter/cpu_all/states",
                    help="the drafter's states folder: its sequences are the data (their states are recomputed)")
    ap.add_argument("--drafter", default="checkpoints/drafter-qwen-coder-1.5b-cpu", help="both variants start here")
    ap.add_argument("--target", default="default")
    ap.add_argument("--layers", default="2,14,25", help="a, b, c: the layers whose input the fused variant reads")
    ap.add_argument("--train-seqs", type=int, default=600)
    ap.add_argument("--dev-seqs", type=int, default=48)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--fuse-lr", type=float, default=0.0,
                    help="the fused variant's new fc at this learning rate (0: --lr); a row of its own, so a rerun "
                         "into the same --out adds it beside the rows there")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny random target (4 layers, read at 1,2,3) and drafter, random sequences (smoke test)")
    ap.add_argument("--out", default="eval/results/drafter_features")
    ap.add_argument("--cache", default="runs/drafter_features",
                    help="where the target's states (<cache>/<out's name>/features.pt, gigabytes) and tiny models go")
    ap.add_argument("--report-only", action="store_true", help="run nothing: the report of the rows <out> holds")
    return ap.parse_args(argv)


class Fused(torch.nn.Module):
    """The drafter behind fc([aux, f]): `aux` [B, T, 3H] is set per batch, as drafter_loss passes f alone."""

    def __init__(self, drafter, n_aux: int):
        super().__init__()
        H = drafter.fc.out_features
        self.drafter, self.aux = drafter, None
        self.fc = torch.nn.Linear((n_aux + 1) * H, H, bias=False)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, n_aux * H:] = torch.eye(H)

    def forward(self, f, emb, pos, **kw):
        return self.drafter(self.fc(torch.cat([self.aux[:, :f.shape[1]].to(f.dtype), f], -1)), emb, pos, **kw)


def _rms(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@torch.inference_mode()
def features(model, seqs: list[torch.Tensor], layers: list[int], desc: str) -> list[dict]:
    """Per sequence: ids, the final state f (after the final norm, as the drafter's data) and the RMS-scaled inputs
    of `layers` (aux [T, 3H]), bf16."""
    out = []
    for ids in tqdm(seqs, desc=desc):
        hs = model.base_model(input_ids=ids.view(1, -1), output_hidden_states=True).hidden_states
        aux = torch.cat([_rms(hs[i][0]) for i in layers], -1)
        out.append({"ids": ids, "hidden": hs[-1][0].to(torch.bfloat16), "aux": aux.to(torch.bfloat16)})
    return out


def load_features(args, cfg, cache: Path) -> dict:
    """{"train": [...], "dev": [...]}: computed once into cache/features.pt."""
    f = cache / "features.pt"
    if f.is_file():
        return torch.load(f)
    from transformers import AutoConfig

    from adaptive_spec.backends.models import load_model
    from adaptive_spec.backends.paths import resolve_model_path
    from adaptive_spec.drafter import data

    layers = [int(x) for x in args.layers.split(",")]
    n_layers = AutoConfig.from_pretrained(resolve_model_path(cfg.target, "target")).num_hidden_layers
    if not all(0 < i < n_layers for i in layers):
        raise UserError(f"--layers must lie in 1..{n_layers - 1} for this target ({n_layers} layers), "
                        f"got {args.layers}")
    if args.tiny:
        g = torch.Generator().manual_seed(0)
        ids = {s: [torch.randint(0, 32, (40,), generator=g) for _ in range(n)]
               for s, n in (("train", args.train_seqs), ("dev", args.dev_seqs))}
    else:
        ids = {s: [q["ids"] for q in data.load_split(args.states, s)[:n]]
               for s, n in (("train", args.train_seqs), ("dev", args.dev_seqs))}
    model, _ = load_model(cfg.target, "target", cfg.target_dtype, "cpu", pack=True, fp16=False)
    feats = {s: features(model, v, layers, s) for s, v in ids.items()}
    buf = io.BytesIO()
    torch.save(feats, buf)
    atomic_write(f, buf.getvalue())
    return feats


def batches(seqs: list[dict], size: int, seed: int):
    from adaptive_spec.training.drafter import collate

    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(seed)).tolist()
    for i in range(0, len(order), size):
        part = [seqs[j] for j in order[i:i + size]]
        feats, ids, valid = collate(part)
        aux = collate([{"ids": s["ids"], "hidden": s["aux"]} for s in part])[0]
        yield feats, ids, valid, aux


@torch.no_grad()
def scores(model, readout, seqs: list[dict], cfg) -> dict:
    from adaptive_spec.training.drafter import drafter_loss

    model.eval()
    tot, n = {"top1": 0.0, "accept": 0.0}, 0
    for feats, ids, valid, aux in batches(seqs, 4, 0):
        if isinstance(model, Fused):
            model.aux = aux
        _, parts = drafter_loss(model, readout, feats, ids, valid, cfg, steps=1)
        w = int(valid[:, 1:].sum())
        tot = {k: v + parts[k] * w for k, v in tot.items()}
        n += w
    model.train()
    return {k: v / max(n, 1) for k, v in tot.items()}


def variants(args) -> list[tuple[str, float | None]]:
    """(row name, the fused fc's learning rate; None: the `last` variant)."""
    fused = ("fused", args.lr) if not args.fuse_lr else (f"fused, fc lr {args.fuse_lr:g}", args.fuse_lr)
    return [("last", None), fused]


def train(variant: str, fuse_lr: float | None, drafter, readout, sets: dict, cfg, lr: float) -> dict:
    """One pass over the training sequences from `drafter` (copied); dev scores before and after."""
    from adaptive_spec.training.drafter import drafter_loss

    torch.manual_seed(0)  # the input noise: the same draws for both variants
    model = copy.deepcopy(drafter)
    if fuse_lr is not None:
        model = Fused(model, sets["train"][0]["aux"].shape[-1] // sets["train"][0]["hidden"].shape[-1])
    before = scores(model, readout, sets["dev"], cfg)
    core = model.drafter if fuse_lr is not None else model
    groups = [{"params": [p for p in core.parameters() if p.requires_grad]}]
    if fuse_lr is not None:
        groups.append({"params": list(model.fc.parameters()), "lr": fuse_lr})
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    total = -(-len(sets["train"]) // 4)
    warm = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warm, 1.0 - 0.9 * s / total))
    for feats, ids, valid, aux in tqdm(batches(sets["train"], 4, 1), total=total, desc=variant):
        if isinstance(model, Fused):
            model.aux = aux
        loss, _ = drafter_loss(model, readout, feats, ids, valid, cfg, cfg.noise, steps=1, scores=False)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        sched.step()
    after = scores(model, readout, sets["dev"], cfg)
    return {"variant": variant, "steps": total, **{f"{k}_before": v for k, v in before.items()},
            **{f"{k}_after": v for k, v in after.items()}}


def make_tiny(folder: Path) -> tuple[str, str]:
    from transformers import AutoModelForCausalLM

    from adaptive_spec.backends.toy import save_model
    from adaptive_spec.drafter.model import FeatureDrafter

    t, f = folder / "target", folder / "drafter"
    if not (t / "config.json").is_file():
        save_model(t, vocab_size=32, hidden_size=24, seed=2, logit_scale=4.0, max_positions=512, layers=4)
    if not (f / "config.json").is_file():
        torch.manual_seed(0)
        FeatureDrafter.for_target(AutoModelForCausalLM.from_pretrained(t), name="tiny").save_pretrained(f)
    return str(t), str(f)


def report(out: Path, run: dict, rows: list[dict]) -> None:
    last = next((r for r in rows if r["variant"] == "last"), None)
    table = [[r["variant"], r["steps"], f"{r['top1_before']:.3f}", f"{r['top1_after']:.3f}",
              f"{r['accept_before']:.3f}", f"{r['accept_after']:.3f}"] for r in rows]
    text = (f"# The feature drafter's input: the last layer's state alone, or fused with layers {run['layers']}\n\n"
            f"{run['cpu']}\n\n"
            f"Every row starts from `{run['drafter']}` and takes the same {rows[0]['steps'] if rows else 0} steps "
            "(batch 4, "
            f"lr {run['lr']:g}) over the same {run['train_seqs']} training sequences of `{run['states']}`; scored "
            f"on {run['dev_seqs']} dev sequences ({run['dev_tokens']} slots), first drafted step. top-1: the "
            "drafter's argmax is the target's; accept: the sum of min(p, q) (the expected acceptance at T = 1).\n\n"
            + md_table(["input", "steps", "top-1 before", "top-1 after", "accept before", "accept after"], table)
            + "".join(f"\n\n{r['variant']} against last after training: top-1 "
                      f"{r['top1_after'] - last['top1_after']:+.3f}, accept {r['accept_after'] - last['accept_after']:+.3f}"
                      for r in rows[1:] if last)
            + f"\n\nWritten {run['written']} by `python eval/bench_drafter_features.py`.\n")
    atomic_write(out / "report.md", text)


def _main(argv) -> int:
    from adaptive_spec.backends.cpu.machine import flags_line
    from adaptive_spec.evaluation.paired import run_header
    from adaptive_spec.training.drafter import DrafterConfig, load_readout

    args = parse_args(argv)
    out = Path(args.out)
    if args.report_only:
        report(out, run_header(out, True), read_jsonl(out / "results.jsonl"))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache) / out.name
    cache.mkdir(parents=True, exist_ok=True)
    target, drafter_path = make_tiny(cache / "tiny") if args.tiny else (args.target, args.drafter)
    if args.tiny:
        args.layers = "1,2,3"
    from adaptive_spec.drafter.model import FeatureDrafter

    ce_vocab = FeatureDrafter.from_pretrained(drafter_path).config_dict().get("ce_vocab") or "full"
    cfg = DrafterConfig(data="", target=target, init_from=drafter_path, ce_vocab=str(ce_vocab), rollout=1,
                        report_to="none")
    sets = load_features(args, cfg, cache)
    readout, drafter, _ = load_readout(cfg, "cpu")
    done = {r["variant"]: r for r in read_jsonl(out / "results.jsonl")}
    for v, fuse_lr in variants(args):
        if v not in done:
            done[v] = train(v, fuse_lr, drafter, readout, sets, cfg, args.lr)
            append_jsonl(out / "results.jsonl", done[v])
    run = run_header(out, False, lambda: {
        "script": f"eval/{Path(__file__).name}", "cpu": flags_line(), "threads": torch.get_num_threads(),
        "drafter": "tiny" if args.tiny else args.drafter, "states": "random ids" if args.tiny else args.states,
        "layers": args.layers, "lr": args.lr, "train_seqs": len(sets["train"]), "dev_seqs": len(sets["dev"]),
        "dev_tokens": sum(len(s["ids"]) - 1 for s in sets["dev"]), "tiny": args.tiny})
    report(out, run, list(done.values()))
    print((out / "report.md").read_text())
    return 0


def main(argv=None) -> int:
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
