"""How a model is loaded, besides its folder: the dtype, the device and the quantization, named and checked once.

`printpress.load(..., dtype=, device=, quantize=)` and the command line's runtime flags (`printpress.cli_flags`) both
check their values here, so a bad value ends in one line before a model is read. Imports nothing heavy: the CLI
checks its flags without importing torch.

- dtype: a name of `DTYPES` (the exact path is float32, the default), `AUTO` (a measured choice:
  `printpress.precision`) or `CHECKPOINT` (the dtype the checkpoint was saved in);
- quantize: None, or a name of `QUANTIZE` (`printpress.quantize`: int8 weight-only linear layers; not exact);
- compile: None, or a name of `COMPILE` (`printpress.fast`: the encoder's and/or the decoder's passes as compiled
  graphs; not exact); compile_weights: a name of `COMPILE_WEIGHTS` (bfloat16: the compiled AR steps read bfloat16
  copies of the weights, and a canvas's products run on AMX tiles where the CPU has them);
- canvas_length: None (the checkpoint's `canvas_length`), or the diffusion canvas to decode with instead: what the
  reference decodes with the same value in config.json, so exactness is kept; a trade of speed for quality per
  machine (docs/generation.md, "Canvas length").
"""

from __future__ import annotations

from printpress.errors import CheckpointError

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # name -> torch's name
AUTO = "auto"  # bf16 where it is native and measured faster, fp32 elsewhere (printpress.precision)
CHECKPOINT = "checkpoint"  # the dtype config.json records (float32 if it records none)
QUANTIZE = ("int8", "int8-head")
COMPILE = ("ar", "decoder", "all")  # which passes run compiled: AR steps, decoder passes, or both
COMPILE_WEIGHTS = ("float32", "bfloat16")  # what a compiled AR step's few-row products read (printpress.fast)

DTYPE_HELP = (f"float32 (default; exact), bfloat16, float16, {AUTO} (bfloat16 on a CUDA GPU that supports it or a CPU "
              f"with native bf16 matmul where a load-time measurement finds it faster, else float32), or {CHECKPOINT} "
              "(the dtype the checkpoint was saved in)")
QUANTIZE_HELP = ("int8: weight-only int8 linear layers, one scale per output channel (opt-in, not exact; fewer bytes "
                 "per AR step: docs/benchmarks.md, 'int8 weights')")
COMPILE_HELP = ("ar, decoder or all: run the encoder's passes (AR steps, verifications, prompts), the decoder's or both "
                "as torch.compile graphs (opt-in, not exact; faster per pass; the first passes compile, ~1 minute, "
                "cached on disk after that: docs/generation.md, 'compiled passes')")
COMPILE_WEIGHTS_HELP = ("float32 (default) or bfloat16: with --compile, the compiled AR steps read bfloat16 copies "
                        "of the weights (about 1.25x faster where reading the weights bounds a step) and, on a CPU "
                        "with AMX, a canvas's products run on bfloat16 tiles (the decoder pass about 1.7x faster); "
                        "opt-in, not the float32 model's numbers (docs/generation.md, 'compiled passes')")
CANVAS_HELP = ("diffusion canvas length in tokens (default: the checkpoint's canvas_length); exact, as the "
               "reference with that canvas_length in config.json. On a CPU a shorter canvas is cheaper per token, a "
               "longer one gives more steps per token at the same tokens per forward (docs/generation.md, 'Canvas "
               "length')")


def check_dtype(dtype: object) -> None:
    """Raise CheckpointError unless `dtype` names a dtype `printpress.load` accepts (a torch.dtype is checked by
    the loader)."""
    if isinstance(dtype, str) and dtype not in DTYPES and dtype not in (AUTO, CHECKPOINT):
        names = ", ".join([*list(DTYPES)[:3], AUTO, CHECKPOINT])
        raise CheckpointError(f"dtype {dtype!r} is not supported; use one of {names}")


def check_quantize(quantize: object) -> None:
    """Raise CheckpointError unless `quantize` is None or a name of QUANTIZE."""
    if quantize is not None and quantize not in QUANTIZE:
        raise CheckpointError(f"quantize {quantize!r} is not supported; use {' or '.join(QUANTIZE)} (or leave it out "
                              "for the exact weights)")


def check_compile(compile: object) -> None:
    """Raise CheckpointError unless `compile` is None or a name of COMPILE."""
    if compile is not None and compile not in COMPILE:
        raise CheckpointError(f"compile {compile!r} is not supported; use {', '.join(COMPILE)} (or leave it out for "
                              "the exact eager passes)")


def check_compile_weights(weights: object, compile: object) -> None:
    """Raise CheckpointError unless `weights` is a name of COMPILE_WEIGHTS, and float32 unless some passes are
    compiled: only compiled passes read the copies."""
    if weights not in COMPILE_WEIGHTS:
        raise CheckpointError(f"compile_weights {weights!r} is not supported; use {' or '.join(COMPILE_WEIGHTS)}")
    if weights != "float32" and compile is None:
        raise CheckpointError(f"compile_weights {weights} applies to compiled passes: give compile ar, decoder or all "
                              "too")


def check_canvas_length(canvas_length: object) -> None:
    """Raise CheckpointError unless `canvas_length` is None or a positive int."""
    if canvas_length is None:
        return
    if isinstance(canvas_length, bool) or not isinstance(canvas_length, int) or canvas_length < 1:
        raise CheckpointError(f"canvas_length {canvas_length!r} is not supported; give a positive number of tokens "
                              "(or leave it out for the checkpoint's)")
