"""Which transformers model types' own tensor-parallel plans ``tensor_parallel="auto"`` takes.

    python tools/tp_coverage.py          # the count, and the styles missing by how many types need them
    python tools/tp_coverage.py --list   # and one line per model type: taken, or the styles it lacks
    python tools/tp_coverage.py --build  # and each type taken, built tiny on the meta device and resolved

A model type (``config.model_type``, one family: ``qwen3``, ``mixtral``, ...) has a plan when
its config class has a ``base_model_tp_plan``. "auto" takes a plan whose styles are all
shardfn's (``shardfn._parallel.tensor.AUTO_STYLES``); a plan with another style is refused
by name when a model is sharded. This reads the config classes only: whether a model's
attention splits exactly by heads, and the head counts against the tensor size, are checked
on the model itself, when it is sharded (docs/tensor-parallel.md). The count is the installed
transformers' (constraints.txt pins it); docs/tensor-parallel.md states it, and
tests/test_tp_styles.py checks that the two agree.

``--build`` goes one step further for each type taken: its default configuration shrunk
(hidden 32, 2 layers, 4 heads, 4 experts, ...; :data:`SMALL`), its model built on the meta
device, and its plan resolved at tensor 2 as ``shard`` resolves it: the attention's checks
and the experts' probe run ([Note: experts proven by a probe] in shardfn/_parallel/experts.py).
Each type is "resolved", "refused" (shardfn's error), or "not built" (the shrunk
configuration or the model class failed before shardfn ran: a limit of this tool, not a
verdict).
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


SMALL = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, num_experts=4, num_local_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, vocab_size=64, ffn_hidden_size=64, expert_intermediate_size=16,
             shared_expert_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
             q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1,
             tie_word_embeddings=False, max_position_embeddings=64, decoder_sparse_step=1)


def _shrunk(cfg: object) -> object:
    for k, v in SMALL.items():
        if getattr(cfg, k, None) is not None:
            try:
                setattr(cfg, k, v)
            except Exception:  # (a derived or per-layer attribute: left as it is)
                pass
    if getattr(cfg, "text_config", None) is not None:
        _shrunk(cfg.text_config)
    return cfg


def build(model_type: str) -> tuple[str, str]:
    """``("resolved" | "refused" | "not built", why)`` for ``model_type`` (see ``--build``)."""
    import warnings

    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from shardfn._parallel.tensor import resolve_tensor_parallel

    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            cfg = _shrunk(CONFIG_MAPPING[model_type]())
            try:
                model = AutoModelForCausalLM.from_config(cfg)
            except ValueError:
                model = AutoModel.from_config(cfg)
    except Exception as e:
        return "not built", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    try:
        resolve_tensor_parallel("auto", model, dict(model.state_dict()), 2)
    except ValueError as e:
        return "refused", str(e)[:300]
    return "resolved", ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="one line per model type")
    p.add_argument("--build", action="store_true", help="build each type taken tiny on meta and resolve its plan")
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
    if args.build:
        import transformers

        transformers.logging.set_verbosity_error()
        verdicts = collections.Counter()
        for t in taken:
            verdict, why = build(t)
            verdicts[verdict] += 1
            print(f"{t}: {verdict}" + (f": {why}" if why else ""), flush=True)
        print(f"of the {len(taken)} taken, built tiny at tensor 2: " + ", ".join(f"{n} {v}" for v, n in
                                                                                  verdicts.most_common()))


if __name__ == "__main__":
    main()
