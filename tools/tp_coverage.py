"""Which transformers model types' own tensor-parallel plans ``tensor_parallel="auto"`` takes.

    python tools/tp_coverage.py          # the count, and the styles missing by how many types need them
    python tools/tp_coverage.py --list   # and one line per model type: taken, or the styles it lacks

A model type (``config.model_type``, one family: ``qwen3``, ``mixtral``, ...) has a plan when
its config class has a ``base_model_tp_plan``. "auto" takes a plan whose styles are all
shardfn's (``shardfn._parallel.tensor.AUTO_STYLES``); a plan with another style is refused
by name when a model is sharded. This reads the config classes only: whether a model's
attention splits exactly by heads, and the head counts against the tensor size, are checked
on the model itself, when it is sharded (docs/tensor-parallel.md). The count is the installed
transformers' (constraints.txt pins it); docs/tensor-parallel.md states it, and
tests/test_tp_styles.py checks that the two agree.
"""

from __future__ import annotations

import argparse
import collections


def coverage() -> tuple[str, dict[str, tuple[str, ...]]]:
    """``(transformers version, {model type: the styles of its plan that "auto" lacks})``
    for every model type with a plan; an empty tuple: "auto" takes it."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    from shardfn._parallel.tensor import AUTO_STYLES

    out = {}
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        plan = getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None)
        if plan:
            out[model_type] = tuple(sorted({s for s in plan.values() if s not in AUTO_STYLES}))
    return transformers.__version__, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="one line per model type")
    args = p.parse_args()
    version, found = coverage()
    taken = [t for t, missing in found.items() if not missing]
    print(f"transformers {version}: \"auto\" takes the plans of {len(taken)} of the {len(found)} model types "
          "that have one")
    needed = collections.Counter(s for missing in found.values() for s in missing)
    for style, n in needed.most_common():
        print(f"  {style}: needed by {n}")
    if args.list:
        for t, missing in found.items():
            print(f"{t}: " + ("taken" if not missing else "lacks " + ", ".join(missing)))


if __name__ == "__main__":
    main()
