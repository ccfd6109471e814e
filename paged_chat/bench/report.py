"""The benchmark's report: a text table with the scenario lines, a PNG plot, JSON."""

from __future__ import annotations

import json

from paged_chat.bench.systems import DESCRIPTIONS
from paged_chat.bench.tier_resume import format_tier_resume


def format_report(report: dict) -> str:
    columns = [("system", "{}"), ("output_tokens_per_s", "{:.1f}"), ("total_tokens_per_s", "{:.1f}"),
               ("mean_ttft_s", "{:.2f}"), ("p90_ttft_s", "{:.2f}"), ("mean_tpot_ms", "{:.1f}"),
               ("peak_rss_mb", "{:.0f}"), ("vs_hf_seq", "{:.2f}x")]
    rows = [[name for name, _ in columns]]
    for summary in report["systems"]:
        rows.append([fmt.format(summary[name]) if summary.get(name) is not None else "-"
                     for name, fmt in columns])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    lines += [f"  {summary['system']}: {_describe(summary)}" for summary in report["systems"]]
    paged = next((s for s in report["systems"] if s["system"] == "paged-chat"), None)
    lines.append(f"dtypes: paged-chat {report['dtypes']['paged-chat']}, the HF baselines "
                 f"{report['dtypes']['baselines']}")
    if paged:
        lines.append(f"paged-chat: peak batch {paged['peak_batch_size']}, preemptions "
                     f"{paged['preemptions']}, prefix-cache hit tokens {paged['prefix_cache_hit_tokens']}, "
                     f"KV waste at peak {100 * paged['kv_waste_at_peak']:.2f}%, host overhead "
                     f"{100 * paged['host_overhead']:.1f}% of step time")
    for server in (s for s in report["systems"] if "server_model" in s):
        lines.append(f"{server['system']}: {server['served_by']} serving {server['server_model']} "
                     f"on its own weights, dtype and threads (prompts sent as {server['prompts_as']})"
                     + (f"; {server['replies_cut_short']} replies ended early (EOS not ignored?)"
                        if server["replies_cut_short"] else ""))
    static = next((s for s in report["systems"] if s["system"] == "hf-static"), None)
    if static:
        lines.append(f"hf-static: {100 * static['decode_padding_waste']:.0f}% of decode slots are padding")
    if "scenarios" in report:
        fit = report["scenarios"]["fit"]
        ttft = report["scenarios"]["system_prompt_ttft"]
        lines.append(f"KV budget of {fit['kv_budget_tokens']} tokens: contiguous at max_model_len "
                     f"{fit['max_model_len']} holds {fit['contiguous_chats']} chats, paged held "
                     f"{fit['paged_chats_resident_at_once']} at once ({fit['ratio']:.1f}x)")
        lines.append(f"new chat, system prompt cold {1e3 * ttft['cold_s']:.0f} ms vs cached "
                     f"{1e3 * ttft['cached_s']:.0f} ms to first token ({ttft['speedup']:.1f}x; "
                     f"{ttft['cached_tokens']} tokens from the cache)")
        turns = ", ".join(f"{t['prefilled']}/{t['prompt_tokens']}"
                          for t in report["scenarios"]["five_turn_chat"])
        lines.append(f"5-turn chat, tokens prefilled / in prompt per turn: {turns}")
        lines.append(format_tier_resume(report["scenarios"]["tier_resume"]))
    if "roofline" in report:
        roof = report["roofline"]
        lines.append(f"machine ({roof['machine_threads']} threads): {roof['bandwidth_gb_s']:.0f} "
                     f"GB/s, {roof['matmul_gflop_s']:.0f} GFLOP/s; decode step at batch "
                     f"{roof['decode_batch']} (threads: {roof['decode_step_threads']}): "
                     f"{roof['decode_step_ms']:.1f} ms vs floor {roof['floor_ms']:.1f} ms "
                     f"({100 * roof['of_floor']:.0f}% of the machine's limit)")
    return "\n".join(lines)


def _describe(summary: dict) -> str:
    """What a system of the table is, and how much of it was measured."""
    name = summary["system"].split(" +")[0]  # "+N busy": the same system beside busy processes
    words = DESCRIPTIONS.get(name) or ("an OpenAI-compatible server" if "server_model" in summary else name)
    if "measured_requests" in summary:
        words += (f"; {summary['measured_requests']} requests run in "
                  f"{summary['measured_wall_s']:.0f} s, the others extrapolated")
    return words


def plot(report: dict, path: str) -> None:
    """Output tokens/s per system, and paged-chat's KV blocks over time, as one PNG."""
    try:
        import matplotlib
    except ImportError as error:
        raise RuntimeError("--plot needs matplotlib: pip install 'paged-chat[bench]'") from error
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (bars, occupancy) = pyplot.subplots(1, 2, figsize=(12, 4.5))
    systems = report["systems"]
    bars.bar([s["system"] for s in systems], [s["output_tokens_per_s"] for s in systems],
             color=["#d9534f" if s["system"] == "paged-chat" else "#8c8c8c" for s in systems])
    bars.set_ylabel("output tokens/s")
    dtypes = report["dtypes"]
    bars.set_title(f"{report['workload']['chats']} concurrent chats: paged-chat {dtypes['paged-chat']}, "
                   f"baselines {dtypes['baselines']}")
    paged = next((s for s in systems if s["system"] == "paged-chat"), None)
    if paged:
        times, in_use, cached, running = zip(*paged["timeline"])
        occupancy.stackplot(times, in_use, cached, labels=["in use", "cached"],
                            colors=["#d9534f", "#f0ad4e"])
        occupancy.set_ylim(0, max(max(in_use) + max(cached), 1) * 1.1)
        occupancy.set_xlabel("seconds")
        occupancy.set_ylabel("KV blocks")
        occupancy.set_title(f"paged-chat KV pool ({paged['num_blocks']} blocks)")
        running_axis = occupancy.twinx()
        running_axis.plot(times, running, color="#337ab7", label="running")
        running_axis.set_ylabel("running requests")
        occupancy.legend(loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def write_json(report: dict, path: str) -> None:
    with open(path, "w") as out:
        json.dump(report, out, indent=2)
