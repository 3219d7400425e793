"""GRPO's math, pure and small: group-relative advantages and the clipped policy loss.

Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, §4.1): for each prompt (here: a
maze) sample a group of G episodes, score them, and use the reward standardised *within the group* as the advantage
of every token of the episode; no value network. The loss is PPO's clipped surrogate (Schulman et al. 2017,
arXiv:1707.06347) with the rollout policy as the old policy, plus an optional KL penalty to the reference policy with
the k3 estimator (Schulman 2020, "Approximating KL divergence").

Multi-turn: one episode is several turns; the learner sees one sequence per turn (the turn's context window and the
tokens sampled in it). An episode's advantage is broadcast to every assistant token of every one of its turns, and the
"sequence" of the aggregation modes is the episode, so a long episode does not count as many sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADVANTAGE_EPS = 1e-6


def group_advantages(rewards: torch.Tensor, norm: str = "group-std", eps: float = ADVANTAGE_EPS
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages.

    Args:
        rewards: ``[M, G]`` float, episode rewards, one row per group (maze), G episodes each.
        norm: ``"group-std"``: ``(r - mean_g) / (std_g + eps)`` (GRPO, DeepSeekMath eq. in §4.1.2, population std over
            the group as in TRL); ``"none"``: ``r - mean_g`` (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783, which drops
            the std normalisation to remove the difficulty bias).
        eps: added to the std, avoids division by zero.

    Returns:
        ``(advantages [M, G], zero_variance [M] bool)``: groups where every episode got the same reward carry no
        learning signal; their advantages are exactly 0.

    Raises:
        ValueError: ``rewards`` is not 2-D or ``norm`` is unknown.
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [groups, group_size], got shape {tuple(rewards.shape)}")
    mean = rewards.mean(dim=1, keepdim=True)
    centred = rewards - mean
    zero_variance = (rewards == rewards[:, :1]).all(dim=1)
    if norm == "group-std":
        std = rewards.std(dim=1, unbiased=False, keepdim=True)
        adv = centred / (std + eps)
    elif norm == "none":
        adv = centred
    else:
        raise ValueError(f"unknown advantage normalisation {norm!r}; use 'group-std' or 'none'")
    adv = torch.where(zero_variance[:, None], torch.zeros_like(adv), adv)
    return adv, zero_variance


@dataclass
class LossStats:
    """Diagnostics of one loss evaluation (floats, detached)."""

    loss: float
    """The aggregated loss."""
    kl: float
    """Mean k3 KL estimate to the reference over assistant tokens (0 without a reference)."""
    clip_fraction: float
    """Fraction of assistant tokens whose ratio was clipped."""
    ratio_mean: float
    """Mean importance ratio pi / pi_old over assistant tokens."""
    tokens: int
    """Number of assistant tokens."""


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    episode_ids: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    aggregation: str = "token-mean",
    num_episodes: int | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Clipped surrogate loss of GRPO over a batch of turn sequences.

    Per assistant token t: ``ratio = exp(logp - logp_old)``, ``pg = -min(ratio * A, clip(ratio, 1 - low, 1 + high) * A)``
    (asymmetric "clip-higher" bounds from DAPO, Yu et al. 2025, arXiv:2503.14476), plus ``kl_coef * k3`` with
    ``k3 = exp(ref - logp) - (ref - logp) - 1``.

    Args:
        logprobs: ``[B, T]`` log-probs of the sampled tokens under the current policy (requires grad).
        old_logprobs: ``[B, T]`` log-probs recorded by the rollout engine (the behaviour policy).
        advantages: ``[B]`` advantage of the episode each row belongs to.
        mask: ``[B, T]`` 1 on assistant (sampled) tokens, 0 on prompt, image and padding tokens.
        episode_ids: ``[B]`` long, index of the episode of each row (several rows per multi-turn episode).
        ref_logprobs: ``[B, T]`` reference log-probs (adapter disabled), required when ``kl_coef > 0``.
        aggregation: ``"token-mean"``: sum over all assistant tokens / their count (DAPO);
            ``"seq-mean-token-sum"``: per episode the token sum, mean over episodes (Dr. GRPO);
            ``"seq-mean-token-mean"``: per episode the token mean, mean over episodes (original GRPO).
        num_episodes: number of episodes (default ``episode_ids.max() + 1``).

    Returns:
        ``(loss scalar, LossStats)``.

    Raises:
        ValueError: unknown ``aggregation``, shape mismatch, or ``kl_coef > 0`` without ``ref_logprobs``.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(f"shape mismatch: logprobs {tuple(logprobs.shape)}, old {tuple(old_logprobs.shape)}, "
                         f"mask {tuple(mask.shape)}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    mask = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)[:, None]  # [B, 1]
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high) * adv
    per_token = -torch.minimum(unclipped, clipped)  # [B, T]
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None:
        delta = (ref_logprobs - logprobs) * mask
        kl = torch.exp(delta) - delta - 1.0
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl
    per_token = per_token * mask

    n_tokens = mask.sum()
    if aggregation == "token-mean":
        loss = per_token.sum() / n_tokens.clamp(min=1)
    elif aggregation in ("seq-mean-token-sum", "seq-mean-token-mean"):
        n_ep = int(num_episodes if num_episodes is not None else int(episode_ids.max()) + 1)
        ep_sum = torch.zeros(n_ep, dtype=per_token.dtype, device=per_token.device)
        ep_sum = ep_sum.index_add(0, episode_ids, per_token.sum(dim=1))
        if aggregation == "seq-mean-token-mean":
            ep_tokens = torch.zeros(n_ep, dtype=mask.dtype, device=mask.device).index_add(0, episode_ids, mask.sum(1))
            ep_sum = ep_sum / ep_tokens.clamp(min=1)
        loss = ep_sum.mean()
    else:
        raise ValueError(f"unknown loss aggregation {aggregation!r}; use token-mean, seq-mean-token-sum or "
                         "seq-mean-token-mean")

    with torch.no_grad():
        denom = float(n_tokens.clamp(min=1))
        was_clipped = ((ratio < 1.0 - clip_ratio_low) & (adv < 0)) | ((ratio > 1.0 + clip_ratio_high) & (adv > 0))
        stats = LossStats(
            loss=float(loss.detach()),
            kl=float((kl * mask).sum() / denom),
            clip_fraction=float((was_clipped.to(mask.dtype) * mask).sum() / denom),
            ratio_mean=float((ratio * mask).sum() / denom),
            tokens=int(n_tokens),
        )
    return loss, stats
