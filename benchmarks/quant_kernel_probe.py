#!/usr/bin/env python3
"""Weight bytes read per second by each CPU kernel over the default model's linear layers,
against the machine's copy bandwidth; one run, figures to stdout.

The default model (SmolLM2-135M-Instruct, Q4_1 + Q8_0 GGUF) is loaded twice: quantized
(engine/models/quant/) and dequantized to float32 then packed for oneDNN, as the engine
runs each. Each kernel runs alone, then "engine" runs each layer's LayerMatmul (which picks the
kernel for the row count) from Python, and "fused" the same kernels from one C loop, as
the fused decode step runs them (benchmarks/linear_step.c). For activations of 1..32 rows,
every linear layer of one decode step (Q/K/V,
output, gate/up, down of each layer, the output projection) runs back to back through
each kernel; a kernel's rate is the bytes of weights it holds over the time of one pass.
Copy bandwidth: a 256 MiB float32 copy, bytes read + written per second.

    HF_HUB_OFFLINE=1 python -m benchmarks.quant_kernel_probe [--threads 2] [--rows 1 4 8 16 32]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paged_chat.engine.models import fused_decode
from paged_chat.engine.models.loader import load_model, load_model_source
from paged_chat.engine.models.packed_linear import pack_for_cpu
from paged_chat.engine.models.quant import kernels
from paged_chat.engine.native import bindings
from paged_chat.engine.native.build import compile_library


def best_of(run, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls (the machine is shared: the least
    disturbed run is the kernel's own speed)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth(repeats: int) -> float:
    """Bytes read + written per second by a 256 MiB float32 copy."""
    source = torch.empty(64 << 20)
    target = torch.empty_like(source)
    return 2 * source.nbytes / best_of(lambda: target.copy_(source), repeats)


def cpu_line() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True,
                           check=False).stdout.splitlines()
    fields = dict(line.split(":", 1) for line in lscpu if ":" in line)
    flags = fields.get("Flags", "").split()
    wanted = [f for f in flags if f.startswith(("avx", "amx", "fma"))]
    return f"{fields.get('Model name', '?').strip()}, flags {' '.join(wanted)}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"cpu: {cpu_line()}; torch {torch.__version__}, {args.threads} threads")
    copy = copy_bandwidth(args.repeats)
    print(f"copy bandwidth: {copy / 1e9:.1f} GB/s (read + write)")

    model_source = load_model_source("smollm2-135m")
    quantized = load_model(model_source, torch.float32, torch.device("cpu"))
    layers = list(quantized.quantized_layers().values())
    quantized_bytes = sum(layer.nbytes for layer in layers)
    dense = load_model(model_source, torch.float32, torch.device("cpu"), weights="dequantize")
    pack_for_cpu(dense)
    dense_layers = [m for name, m in dense.named_modules() if type(m).__name__ == "PackedLinear"]
    dense_bytes = sum(4 * m.in_features * m.out_features for m in dense_layers)
    print(f"decode-step linear layers: {len(layers)} quantized ({quantized.held_formats()}, "
          f"{quantized_bytes / 1e6:.0f} MB) vs {len(dense_layers)} float32 packed "
          f"({dense_bytes / 1e6:.0f} MB)")
    fused = compile_library("linear-step", [Path(__file__).with_name("linear_step.c"),
                                            *bindings.SOURCES])
    if fused is not None:
        fused.ls_products.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_int]
    structs = (bindings.LinearStruct * len(layers))(
        *[fused_decode.linear_struct(layer) for layer in layers])
    kernel_runs = {"stream (pc_matmul)": kernels.stream_matmul,
                   "gemm (pc_gemm)": kernels.gemm_matmul,
                   "tile (dequantize + MKL)": kernels.tile_matmul}
    print(f"{'rows':>4} | {'kernel':<26} | {'ms/step':>8} | {'weight GB/s':>11} | of copy")
    with torch.inference_mode():
        for rows in args.rows:
            xs = {n: torch.randn(rows, n) for n in {layer.in_features for layer in layers}}
            for name, kernel in kernel_runs.items():
                def step(kernel=kernel, rows=rows, xs=xs) -> None:
                    for layer in layers:
                        out = torch.empty(rows, layer.out_features)
                        start = 0
                        for part in layer.parts:
                            kernel(xs[layer.in_features], part, out[:, start:start + part.rows])
                            start += part.rows
                seconds = best_of(step, args.repeats)
                rate = quantized_bytes / seconds
                print(f"{rows:>4} | {name:<26} | {seconds * 1e3:8.2f} | {rate / 1e9:11.1f} | "
                      f"{rate / copy:.0%}")
            def engine_step(rows=rows, xs=xs) -> None:
                for layer in layers:
                    layer.matmul(xs[layer.in_features], torch.empty(rows, layer.out_features))
            seconds = best_of(engine_step, args.repeats)
            rate = quantized_bytes / seconds
            print(f"{rows:>4} | {'engine (LayerMatmul picks)':<26} | {seconds * 1e3:8.2f} | "
                  f"{rate / 1e9:11.1f} | {rate / copy:.0%}")
            if fused is not None:
                widest = max(max(layer.in_features, layer.out_features) for layer in layers)
                x, out = torch.randn(rows, widest), torch.empty(rows, widest)
                seconds = best_of(lambda x=x, out=out, rows=rows: fused.ls_products(
                    structs, len(layers), rows, kernels.STREAM_MAX_ROWS, x.data_ptr(),
                    out.data_ptr(), args.threads), args.repeats)
                rate = quantized_bytes / seconds
                print(f"{rows:>4} | {'fused (the same, from C)':<26} | {seconds * 1e3:8.2f} | "
                      f"{rate / 1e9:11.1f} | {rate / copy:.0%}")
            seconds = best_of(lambda xs=xs: [m(xs[m.in_features]) for m in dense_layers],
                              args.repeats)
            rate = dense_bytes / seconds
            print(f"{rows:>4} | {'float32 oneDNN (dequantized)':<26} | {seconds * 1e3:8.2f} | "
                  f"{rate / 1e9:11.1f} | {rate / copy:.0%}")


if __name__ == "__main__":
    main()
