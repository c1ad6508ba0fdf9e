"""Command-line flags shared by every command that generates (`generate`, `edit`, `eval`): one spelling, one
parser, one way back to `Pipeline.generate` keywords.

Imports nothing heavy at module level: the CLI builds its parser (and answers --help) without importing torch.
"""

from __future__ import annotations

import argparse
import sys

from printpress.errors import GenerationError

STDIN = "-"  # a prompt (or text) argument that says "read it from stdin"

# (flag, setting name as in SamplerSettings / Pipeline.generate, type, help)
SAMPLER_FLAGS = (
    ("--mode", "mode", str, "diffusion (default), ar, or speculative (diffusion drafts, AR verifies)"),
    ("--max-new-tokens", "max_new_tokens", int, "new tokens to print (diffusion computes whole canvases and keeps "
                                                "this many)"),
    ("--steps", "max_denoising_steps", int, "maximum denoising steps per diffusion canvas"),
    ("--draft-steps", "draft_steps", int, "mode speculative: denoising steps per draft (default 1)"),
    ("--entropy-bound", "entropy_bound", float, "entropy bound for accepting tokens"),
    ("--t-min", "t_min", float, "temperature at the last step"),
    ("--t-max", "t_max", float, "temperature at the first step"),
    ("--stability-threshold", "stability_threshold", int, "stable steps needed to stop early"),
    ("--confidence-threshold", "confidence_threshold", float, "mean entropy needed to stop early"),
    ("--temperature", "temperature", float, "ar, speculative: sampling temperature (0 = greedy; default: the "
                                            "checkpoint's, else 0.8); diffusion: multiplies the t-max -> t-min "
                                            "schedule (1 = as set, 0 = coldest)"),
    ("--top-k", "top_k", int, "ar, speculative: sample among the k most likely tokens (default: the checkpoint's, "
                              "else 50)"),
)


def add_sampler_arguments(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """The sampler flags (all but the settings named in `skip`) and the runtime flags (--dtype, --device)."""
    sampler = p.add_argument_group("sampler settings (default: the checkpoint's generation_config.json)")
    for flag, dest, kind, text in SAMPLER_FLAGS:
        if dest not in skip:
            sampler.add_argument(flag, dest=dest, type=kind, default=None, help=text,
                                 metavar=flag[2:].upper().replace("-", "_"))
    if "eos_token_ids" not in skip:
        sampler.add_argument("--eos", default=None, help="end-of-sequence ids, comma separated ('' for none)")
    sampler.add_argument("--sample-accepted-only", action="store_true", default=None,
                         help="faster, not token-exact to the reference: sample only accepted positions")
    runtime = p.add_argument_group("runtime")
    runtime.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    runtime.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")


def sampler_overrides(args: argparse.Namespace) -> dict:
    """The sampler settings given on the command line, as `Pipeline.generate` keywords.

    Each value is checked on its own here (`sampling.check_setting`: an unknown mode, NaN, inf, 1e-38 or 10^11
    steps end in one line before a model is loaded), and --steps with --mode speculative is refused
    (`sampling.refuse_canvas_steps`); the checks between settings run when the checkpoint's defaults are known.
    """
    from printpress.sampling import check_setting, refuse_canvas_steps

    given = {dest: getattr(args, dest, None) for _, dest, _, _ in SAMPLER_FLAGS}
    given["sample_accepted_only"] = args.sample_accepted_only
    eos = getattr(args, "eos", None)
    if eos is not None:
        given["eos_token_ids"] = parse_ids(eos, allow_empty=True)
    settings = {name: value for name, value in given.items() if value is not None}
    for name, value in settings.items():
        check_setting(name, value)
    refuse_canvas_steps(settings.get("mode"), settings.get("max_denoising_steps"))
    return settings


def sampler_flags_given(args: argparse.Namespace) -> list[str]:
    """The sampler and runtime flags of `args` spelled out again (for a reproducing command line)."""
    words: list[str] = []
    for flag, dest, _, _ in SAMPLER_FLAGS:
        if getattr(args, dest, None) is not None:
            words += [flag, str(getattr(args, dest))]
    if getattr(args, "eos", None) is not None:
        words += ["--eos", args.eos]
    if args.sample_accepted_only:
        words.append("--sample-accepted-only")
    if args.dtype != "float32":
        words += ["--dtype", args.dtype]
    if args.device != "cpu":
        words += ["--device", args.device]
    return words


def parse_ids(text: str, allow_empty: bool = False) -> list[int]:
    parts = text.replace(",", " ").split()
    if not parts and not allow_empty:
        raise GenerationError("the prompt is empty; give at least one token id")
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise GenerationError(f"token ids must be integers separated by commas or spaces, got {text!r}") from None


def read_prompts(prompts: list[str]) -> list[str]:
    """The prompt arguments with `-` replaced by stdin's text (all of it, as is; one `-` at most)."""
    if prompts.count(STDIN) > 1:
        raise GenerationError("'-' (read the prompt from stdin) may be given once")
    if STDIN not in prompts:
        return prompts
    text = sys.stdin.read()
    if not text:
        raise GenerationError("'-' reads the prompt from stdin, and stdin was empty")
    return [text if p == STDIN else p for p in prompts]
