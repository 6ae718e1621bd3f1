"""The SSD paper's speed model (Theorem 7), evaluated from measured quantities, beside the measurement.

  speedup over AR = [p_hit E_hit + (1 - p_hit) E_miss] / [p_hit max(1, T_p) + (1 - p_hit)(1 + T_b)]

E_hit / E_miss: expected tokens per round (accepted + 1) when the verified speculation came from the
cache / from a backup; T_p, T_b: primary (tree) and backup draft latency in units of one verification.
The formula counts time in verifications; converting to AR steps multiplies by
(AR step latency / verification latency), which is ~1 on a GPU and measurably > 1 on this CPU
(a K+1-token verification costs more than one decode step).
"""
from __future__ import annotations

import numpy as np


def predicted_speedup(ssd_runs, ar_tokens_per_s: float | None) -> dict:
    rounds = [entry for run in ssd_runs for entry in run.stats.get("timeline", [])]
    if not rounds:
        return {}
    verify = np.mean([r["verify"][1] - r["verify"][0] for r in rounds])
    primary = [r for r in rounds if r["source"][0] == "primary"]
    backup = [r for r in rounds if r["source"][0] != "primary"]
    p_hit = len(primary) / len(rounds)
    e_hit = float(np.mean([r["accepted"][0] + 1 for r in primary])) if primary else 0.0
    e_miss = float(np.mean([r["accepted"][0] + 1 for r in backup])) if backup else 0.0
    t_p = float(np.mean([r["draft"][1] - r["draft"][0] for r in rounds]) / verify)
    backup_times = [r["backup_s"] for r in rounds if r["backup"]]
    t_b = float(np.mean(backup_times) / verify) if backup_times else 0.0
    per_verification = (p_hit * e_hit + (1 - p_hit) * e_miss) / (p_hit * max(1.0, t_p) + (1 - p_hit) * (1 + t_b))
    out = {"p_hit": p_hit, "E_hit": e_hit, "E_miss": e_miss, "T_p": t_p, "T_b": t_b,
           "verify_latency_s": float(verify), "tokens_per_verification_time": per_verification}
    if ar_tokens_per_s:
        ar_step = 1.0 / ar_tokens_per_s
        out["ar_step_latency_s"] = ar_step
        out["predicted_speedup_vs_ar"] = per_verification * ar_step / verify
    return out
