"""Ring all-reduce (companion.collectives) against gloo's dist.all_reduce: 4 ranks, 16-64 MB.

Goal: ours within 1.5x of gloo's time. Run: python benchmarks/bench_collectives.py
Prints one line per size: best of 3 timed calls (after a warm-up), slowest rank's time.
"""
from companion import collectives, launch

WORLD = 4


def main() -> None:
    print(f"all-reduce of float32 on {WORLD} gloo ranks (best of 3, slowest rank)")
    for mb in (16, 32, 64):
        numel = mb * 2**20 // 4
        times = {impl: max(t for t, _ in launch.run(collectives.time_all_reduce, WORLD, impl,
                                                    numel, 3, timeout=600))
                 for impl in ("ring", "gloo")}
        print(f"{mb:>3} MiB: ring {times['ring']:.3f} s | gloo {times['gloo']:.3f} s | "
              f"ratio {times['ring'] / times['gloo']:.2f}x (goal <= 1.5x)")


if __name__ == "__main__":
    main()
