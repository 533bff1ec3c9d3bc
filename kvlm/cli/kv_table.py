"""`kvlm kv-table`: KV cache and parameter accounting of presets (the papers' tables), from kvlm.accounting.

Prints one table per ``--preset`` / ``--config`` group (and the presets skipped, with the reason); with
``--json`` the last stdout line is one JSON object with every row."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvlm.accounting import DTYPE_BYTES, _reference, format_table, kv_table, select
from kvlm.bench.costmodel import HARDWARE, format_projection, get_hardware, projection_rows
from kvlm.cli.common import parse_int_list
from kvlm.config import ConfigError, ModelConfig
from kvlm.preset_table import families, get_preset, match_ffn_dim, presets


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        action="append",
        default=[],
        help="a family (" + ", ".join(families()) + "), a name prefix (small-lm/6L-512d) or a preset name; "
        "repeat or comma-separate for several",
    )
    p.add_argument(
        "--config", action="append", default=[], help="a model config file (YAML/JSON); repeatable"
    )
    p.add_argument(
        "--tp", default="1,2,4,8", help="tensor-parallel degrees, comma-separated (default 1,2,4,8)"
    )
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES), help="cache dtype (default bf16)")
    p.add_argument(
        "--match-ffn", action="store_true", help="match each model's FFN width to its group's MHA first"
    )
    p.add_argument("--no-params", action="store_true", help="skip parameter counts (faster)")
    p.add_argument("--list", action="store_true", help="list the families and preset names, then exit")
    p.add_argument(
        "--hardware",
        default=None,
        help="also project decode time per model on these devices, comma-separated: cpu-measured (this "
        "machine, measured now at --threads), "
        + ", ".join(HARDWARE)
        + " (published specs); default: no projection",
    )
    p.add_argument("--batch", type=int, default=1, help="sequences per decode step (default 1)")
    p.add_argument("--context", type=int, default=4096, help="cached tokens per sequence (default 4096)")
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads for cpu-measured (default: torch's)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def main(args: argparse.Namespace) -> int:
    if args.list:
        fams = families()
        for fam, names in fams.items():
            print(f"{fam} ({len(names)}): {', '.join(n.split('/', 1)[1] for n in names)}")
        if args.json:
            print(json.dumps({"families": fams, "presets": presets()}))
        return 0
    if not args.preset and not args.config:
        raise ConfigError("kv-table needs --preset FAMILY|NAME or --config FILE (see --list)")
    tps = sorted(set(parse_int_list(args.tp, "tp")))
    dtype_bytes = DTYPE_BYTES[args.dtype]
    groups: list[tuple[str, Any]] = [(spec, _available(spec, args.match_ffn)) for spec in args.preset]
    groups += [(path, {path: ModelConfig.load(path)}) for path in args.config]
    hardware = _hardware(args)
    all_rows, skipped, projections = [], {}, []
    for i, (title, models) in enumerate(groups):
        if isinstance(models, tuple):
            models, missing = models
            skipped.update(missing)
        rows = kv_table(models, tp=tps, dtype_bytes=dtype_bytes, params=not args.no_params) if models else []
        all_rows += rows
        if i:
            print()
        print(f"# kv-table: {title}")
        if rows:
            print(format_table(rows, tps, args.dtype))
        if rows and hardware:
            proj = projection_rows(models, hardware, args.batch, args.context)
            projections += proj
            print(
                f"\n# decode floor per step, batch {args.batch}, {args.context} cached tokens "
                "(sum over operations of max(bytes / bandwidth, FLOPs / peak); weights and cache in "
                + ", ".join(f"{hw.name} {hw.dtype}" for hw in hardware)
                + ")"
            )
            print(format_projection(proj, hardware))
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    if not all_rows:
        raise ConfigError(
            "no model could be tabulated: " + "; ".join(f"{n}: {w}" for n, w in skipped.items())
        )
    if args.json:
        print(
            json.dumps(
                {
                    "tp": tps,
                    "dtype": args.dtype,
                    "dtype_bytes": dtype_bytes,
                    "rows": all_rows,
                    "skipped": skipped,
                    **({"projections": projections} if hardware else {}),
                }
            )
        )
    return 0


def _hardware(args: argparse.Namespace) -> list:
    """The devices of ``--hardware`` (cpu-measured is measured once, here), or [] without it."""
    if not args.hardware:
        return []
    if args.batch < 1 or args.context < 0:
        raise ConfigError(f"need --batch >= 1 and --context >= 0, got {args.batch}, {args.context}")
    names = [n for n in args.hardware.split(",") if n.strip()]
    if not names:
        raise ConfigError("--hardware needs at least one device name")
    return [get_hardware(n, args.threads) for n in names]


def _available(spec: str, match_ffn: bool) -> tuple[dict[str, ModelConfig], dict[str, str]]:
    """The presets of ``spec`` that build in this installation (a mechanism may be missing), FFN-matched to
    their group's MHA if asked; the others with the reason."""
    out, missing = {}, {}
    for name in select(spec):
        try:
            cfg = get_preset(name)
            if match_ffn:
                ref = _reference(name, cfg, [], "mha")
                if ref is not None and ref[0] != name:
                    cfg = match_ffn_dim(cfg, ref[1])
        except ConfigError as e:
            missing[name] = str(e)
            continue
        out[name] = cfg
    return out, missing
