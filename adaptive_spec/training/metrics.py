"""The paper's weighted BCE, and what training and the ablations report beside it: binary KL
(Table 3), AUC of accepted vs rejected tokens, calibration (ECE and a reliability plot)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def weighted_bce(logits: torch.Tensor, target: torch.Tensor, w_acc: float = 1.0, w_rej: float = 1.0) -> torch.Tensor:
    """Mean of -w_acc P log p - w_rej (1-P) log(1-p), p = sigmoid(logits); from logits for stability."""
    logits, target = logits.float(), target.float()
    return -(w_acc * target * F.logsigmoid(logits) + w_rej * (1 - target) * F.logsigmoid(-logits)).mean()


def binary_kl(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(P || p) = P log(P/p) + (1-P) log((1-P)/(1-p)) (paper D.3), in float64.

    P is clamped to [0, 1] and 0 log 0 = 0 (xlogy); log p comes from logsigmoid, so p = 0 or 1
    in float32 costs a large but finite value instead of inf."""
    p, z = target.double().clamp(0, 1), logits.double()
    return torch.xlogy(p, p) - p * F.logsigmoid(z) + torch.xlogy(1 - p, 1 - p) - (1 - p) * F.logsigmoid(-z)


def calibration_bins(pred: torch.Tensor, target: torch.Tensor, n_bins: int) -> torch.Tensor:
    """[3, n_bins] float64: count, sum of predictions, sum of targets per equal-width bin of pred."""
    pred, target = pred.double().flatten(), target.double().flatten()
    b = (pred * n_bins).long().clamp(0, n_bins - 1)
    out = torch.zeros(3, n_bins, dtype=torch.float64, device=pred.device)
    out[0].index_add_(0, b, torch.ones_like(pred))
    out[1].index_add_(0, b, pred)
    out[2].index_add_(0, b, target)
    return out


def ece(bins: torch.Tensor) -> float:
    """Expected calibration error: sum over bins of n_b/N |mean pred_b - mean P_b|.

    Bins are `ece_bins` (default 10) equal-width intervals of the predicted acceptance p_hat in
    [0, 1] (p_hat = 1 goes to the last); n_b positions fall in bin b, N in all. The targets are
    probabilities, so calibration compares the mean predicted acceptance with the mean true
    acceptance probability P = min(1, p/q) in each bin. 0 = calibrated; a constant predictor at
    the mean target also scores 0, so read it beside KL and AUC."""
    n = bins[0].sum().item()
    return (bins[1] - bins[2]).abs().sum().item() / n if n else float("nan")


ACCEPTED = 0.99  # AUC's line between accepted and rejected tokens (see auc)


def auc(score: torch.Tensor, target: torch.Tensor) -> float:
    """P(score of a token with P >= 0.99 > score of one with P < 0.99), ties counted half: scikit-learn's
    ROC AUC with the accepted tokens as positives.

    Not P = 1 exactly: where p and q nearly coincide, p/q lands a hair below 1 in floating point,
    and such a token is as good as accepted. NaN when either class is empty."""
    from sklearn.metrics import roc_auc_score  # optional and heavy: the [train]/[eval] extra

    pos = (target.flatten() >= ACCEPTED).cpu().numpy()
    if pos.all() or not pos.any():
        return float("nan")
    return float(roc_auc_score(pos, score.detach().double().flatten().cpu().numpy()))


def prediction_metrics(logits: torch.Tensor, target: torch.Tensor, w_acc: float = 1.0, w_rej: float = 1.0,
                       n_bins: int = 10) -> tuple[dict, torch.Tensor]:
    """({loss, kl, auc, ece, mean_target, mean_pred, n}, calibration bins) of acceptance logits
    against targets P: the numbers training logs and the ablation reports, from one place."""
    z, y = logits.double().flatten(), target.double().flatten()
    pred = torch.sigmoid(z)
    bins = calibration_bins(pred, y, n_bins)
    n = len(y)
    if not n:
        return {"n": 0}, bins
    return {"loss": weighted_bce(z, y, w_acc, w_rej).item(), "kl": binary_kl(y, z).mean().item(), "auc": auc(z, y),
            "ece": ece(bins), "mean_target": y.mean().item(), "mean_pred": pred.mean().item(), "n": n}, bins


def plot_reliability(curves: dict[str, torch.Tensor], path: Path, title: str = ""):
    import matplotlib  # heavy, and the [train]/[eval] extra: only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # as above

    fig, (ax, axh) = plt.subplots(2, 1, figsize=(5, 6), gridspec_kw={"height_ratios": [3, 1]}, sharex=True)
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect")
    n_bins = next(iter(curves.values())).shape[1]
    centers = (np.arange(n_bins) + 0.5) / n_bins
    for name, bins in curves.items():
        cnt, sp, st = bins.cpu().numpy()
        ok = cnt > 0
        ax.plot(sp[ok] / cnt[ok], st[ok] / cnt[ok], "o-", label=f"{name} (ECE {ece(bins):.3f})")
        axh.bar(centers, cnt / max(cnt.sum(), 1), width=1 / n_bins, alpha=0.5, label=name)
    ax.set(ylabel="mean target acceptance prob", title=title, xlim=(0, 1), ylim=(0, 1))
    ax.legend(loc="upper left")
    axh.set(xlabel="predicted acceptance prob", ylabel="share")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
