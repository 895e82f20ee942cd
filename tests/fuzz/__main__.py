"""``python -m tests.fuzz --seconds N --seed S``: fuzz te_v2 for a time budget, print each failure
as a shrunk standalone program, then a summary."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import Counter, defaultdict

from tests.fuzz import campaign
from tests.fuzz.oracle import BF16_RTOL, Verdict, tolerance
from tests.fuzz.programs import FUSINGS, Program, Weights


def main(argv: list[str] | None = None) -> int:
    """Run a campaign; exit status 1 if anything failed."""
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    parser.add_argument("--seconds", type=float, default=600.0, help="time budget, shrinking included")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0, help="index of the first program")
    parser.add_argument("--count", type=int, default=None, help="stop after this many programs")
    parser.add_argument("--shrink-seconds", type=float, default=90.0, help="shrinking budget per failure")
    parser.add_argument(
        "--delayed-every", type=int, default=8, help="every n-th program also with delayed scaling (0: never)"
    )
    parser.add_argument(
        "--show", type=int, default=None, metavar="I", help="print program I's source and verdict, and exit"
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="programs without in-place ops, all with delayed scaling: print the largest errors by class",
    )
    parser.add_argument(
        "--fuser",
        choices=tuple(FUSINGS),
        default="none",
        help="te_v2 alone, or followed by torch.compile's executor with thunderfx's dataflow fusion, "
        "or alone through te_v2_executor.thunderfx (Dynamo first)",
    )
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="each program also under TEv2CUDAGraphTransform, captured by a CPU tape (--fuser none only)",
    )
    parser.add_argument(
        "--grouped-attention",
        type=float,
        default=0.0,
        metavar="W",
        help="weight of attentions over keys and values repeated as Hugging Face's repeat_kv does (0: none, "
        "the programs seeds made before them)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per program")
    args = parser.parse_args(argv)
    if args.graphs and args.fuser != "none":
        parser.error(
            "--graphs needs --fuser none: the CPU tape that stands in for a graph cannot see Inductor's kernels"
        )

    weights = Weights(grouped_attention=args.grouped_attention)
    if args.measure:
        weights = dataclasses.replace(weights, in_place_counts=(1.0,), lora_in_place=0.0)
    if args.show is not None:
        from tests.fuzz.oracle import check
        from tests.fuzz.programs import generate

        program = dataclasses.replace(generate(args.seed, args.show, weights), fusing=FUSINGS[args.fuser])
        print(program.source())
        print(check(program, delayed=True, graphs=args.graphs))
        return 0

    worst: dict[tuple[str, str], float] = defaultdict(float)
    seen: Counter = Counter()

    def on_program(index: int, program: Program, verdict: Verdict) -> None:
        if args.measure and verdict.status == "ok":
            route = "fp8" if verdict.fp8 else "no fp8"
            bound = tolerance(program, verdict.routes)
            fold = "bitwise" if bound is None else "bfloat16" if bound == BF16_RTOL else "within FOLD_RTOL"
            for against, err in verdict.errors.items():
                key = (f"{route}, {fold}", against)
                worst[key] = max(worst[key], err)
                seen[key] += 1
        if args.verbose:
            errors = " ".join(f"{k}={e:.2g}" for k, e in verdict.errors.items())
            print(
                f"[{index}] {verdict.status} {verdict.kind} {errors} | {' '.join(program.kinds())}",
                flush=True,
            )

    def on_failure(failure: campaign.Failure) -> None:
        whose = "te_v2" if failure.verdict.failed else "Thunder's own"
        title = f"## program {failure.index}: {whose}: {failure.verdict.kind}"
        if failure.duplicate_of is not None:
            print(f"{title}, as program {failure.duplicate_of}", flush=True)
            return
        print(f"{title} (found after {failure.elapsed_s:.0f} s)")
        print(failure.script(), flush=True)

    summary = campaign.run(
        args.seed,
        seconds=args.seconds,
        count=args.count,
        start=args.start,
        shrink_budget_s=args.shrink_seconds,
        delayed_every=1 if args.measure else args.delayed_every,
        graphs=args.graphs,
        weights=weights,
        fusing=FUSINGS[args.fuser],
        on_failure=on_failure,
        on_program=on_program,
    )
    print(summary.report())
    for (klass, against), err in sorted(worst.items()):
        print(
            f"largest relative error, te_v2 vs {against}, {klass}: {err:.3g} ({seen[klass, against]} programs)"
        )
    return 1 if summary.failures else 0


if __name__ == "__main__":
    sys.exit(main())
