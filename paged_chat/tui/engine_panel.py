"""The engine panel: pool occupancy, batch, rates, prefix-cache hits, the block map and the
details of the block under the pointer. The app gives it an `EngineStats` snapshot at each
of its frames (`show_stats`); it draws what changed, and never calls the engine. For a
client with no block map (a remote server) it shows what the server's /metrics has
(running, waiting, KV usage, tokens/s, prefix hits; graphs of running and gen tok/s) and
hides what cannot fill: the block map, its legend and detail line, the blocks graph, and
every graph where the server has no vLLM /metrics."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Label, Static

from paged_chat.engine.clients.client_protocol import ClientCapabilities
from paged_chat.engine.core.stats import BlockMap, EngineStats
from paged_chat.tui.block_map import BlockMapView
from paged_chat.tui.legend import Legend
from paged_chat.tui.sparkline import Spark
from paged_chat.tui.tab_info import TabInfo

HISTORY = 30            # sparkline points (6 s at the app's 5 frames a second)


def _n(value: float) -> str:
    return f"{value:,.0f}"


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "0%"


def format_numbers(stats: EngineStats) -> Text:
    """The panel's numbers as a small aligned table."""
    total = stats.num_blocks
    busy = stats.num_running or stats.num_waiting
    rows = [
        ("blocks", f"used {_n(stats.blocks_in_use)} ({_pct(stats.blocks_in_use, total)})  "
                   f"cached {_n(stats.blocks_cached)}  free {_n(stats.blocks_free)}"),
        ("batch", f"{stats.batch_size if busy else 0} seqs · {_n(stats.batch_tokens if busy else 0)} tok"
                  f" · step {stats.step_time_s * 1000:.0f} ms"),
        ("tok/s", f"prompt {_n(stats.prompt_tokens_per_s if busy else 0)} · "
                  f"gen {_n(stats.generation_tokens_per_s if busy else 0)}"),
        ("prefix", f"hit {stats.prefix_cache_hit_rate:.0%} "
                   f"({_n(stats.prefix_cache_hit_tokens)}/{_n(stats.prefix_cache_queried_tokens)} tok)"),
        ("queue", f"running {stats.num_running} · waiting {stats.num_waiting} · "
                  f"preempted {stats.num_preemptions}"),
    ]
    if stats.draft_tokens_total:
        rows.append(("drafts", f"accepted {stats.draft_acceptance_rate:.0%} "
                               f"({_n(stats.accepted_draft_tokens_total)}/"
                               f"{_n(stats.draft_tokens_total)} tok)"))
    if stats.blocks_freed_by_window:
        rows.append(("window", f"freed {_n(stats.blocks_freed_by_window)} blocks behind it"))
    tier = stats.tier
    if tier.disk_error:
        rows.append(("tier", f"off: {tier.disk_error}"))
    elif tier.host_capacity_bytes or tier.disk_capacity_bytes:
        stored = tier.host_bytes + tier.disk_bytes
        capacity = tier.host_capacity_bytes + tier.disk_capacity_bytes
        rows.append(("tier", f"hit {tier.hit_rate:.0%} ({_n(tier.hit_tokens)} tok) · "
                             f"{stored / 2**20:,.0f}/{capacity / 2**20:,.0f} MiB"))
    return _table(rows)


def _table(rows: list[tuple[str, str]]) -> Text:
    text = Text(no_wrap=True, overflow="ellipsis")
    for index, (name, value) in enumerate(rows):
        if index:
            text.append("\n")
        text.append(f"{name:<7}", style="bold")
        text.append(value)
    return text


def with_request_owners(tabs: Mapping[str, TabInfo], blocks: BlockMap) -> Mapping[str, TabInfo]:
    """The tabs, plus an entry for every other owner holding blocks (an API caller under
    `--serve`, by its `user` or "api"), coloured after the tabs."""
    others = [owner for owner in dict.fromkeys(blocks.request_owners)
              if owner is not None and owner not in tabs]
    if not others:
        return tabs
    return {**tabs, **{owner: TabInfo(owner, len(tabs) + index) for index, owner in enumerate(others)}}


def format_remote_numbers(stats: EngineStats, kv_usage: float | None, has_metrics: bool) -> Text:
    """A remote engine's numbers: what its /metrics says, or that it says nothing."""
    if not has_metrics:
        return Text("the server has no vLLM /metrics: each tab shows\nthe TTFT and tokens/s "
                    "this client measures", style="dim")
    rows = [("kv", "?" if kv_usage is None else f"{kv_usage:.0%} used"),
            ("tok/s", f"prompt {_n(stats.prompt_tokens_per_s)} · gen {_n(stats.generation_tokens_per_s)}"),
            ("prefix", f"hit {stats.prefix_cache_hit_rate:.0%}"),
            ("queue", f"running {stats.num_running} · waiting {stats.num_waiting} · "
                      f"preempted {stats.num_preemptions}")]
    return _table(rows)


def describe_block(block_id: int, blocks: BlockMap, block_size: int,
                   tabs: Mapping[str, TabInfo], decode: Callable[[Sequence[int]], str] | None
                   ) -> Text:
    """Id, ref count, owners, cached, and the text of the block's tokens where it is known."""
    ref = int(blocks.ref_counts[block_id])
    cached = bool(blocks.cached[block_id])
    state = "in use" if ref else ("cached (evictable)" if cached else "free")
    text = Text(no_wrap=False)
    text.append(f"block {block_id}", style="bold")
    text.append(f" · ref {ref} · {state}")
    if blocks.from_tier[block_id]:
        text.append(" · read back from the KV tier")
    if ref and cached:
        text.append(" · hashed")
    start, end = int(blocks.holder_ptr[block_id]), int(blocks.holder_ptr[block_id + 1])
    if start == end:
        return text
    holders = [int(h) for h in blocks.holders[start:end]]
    names = []
    for holder in holders:
        owner = blocks.request_owners[holder]
        info = tabs.get(owner) if owner is not None else None
        names.append(info.title if info else (owner or blocks.request_ids[holder]))
    text.append("\nowners: " + ", ".join(dict.fromkeys(names)))
    positions = blocks.holder_positions
    for offset, holder in enumerate(holders):
        owner = blocks.request_owners[holder]
        info = tabs.get(owner) if owner is not None else None
        ids = info.tokens_of(blocks.request_ids[holder]) if info else None
        if ids is None:
            continue
        index = int(positions[start + offset])
        chunk = list(ids[index * block_size:(index + 1) * block_size])
        text.append(f"\ntokens {index * block_size}–{index * block_size + len(chunk) - 1}: ",
                    style="bold")
        text.append(repr(decode(chunk)) if decode and chunk else "(not yet written)")
        return text
    text.append("\ntokens: not known (no open tab streams through this block)", style="dim")
    return text


class EnginePanel(Vertical):
    """Always-visible side panel (collapsible by the app)."""

    # The block (pinned by a click, else under the pointer) whose details are shown.
    focus_block: reactive[int | None] = reactive(None)

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.stats: EngineStats | None = None
        self.tabs: Mapping[str, TabInfo] = {}
        self.decode: Callable[[Sequence[int]], str] | None = None
        self.capabilities: ClientCapabilities | None = None   # the engine client's, once loaded
        self._legend_holders: tuple[str, ...] = ()   # chats holding blocks, as the legend lists them
        self._pinned: int | None = None
        self._shown_text: dict[str, Text] = {}  # what each readout shows
        self._history = {name: deque([0.0] * HISTORY, maxlen=HISTORY)
                         for name in ("batch", "gen", "used")}

    def compose(self) -> ComposeResult:
        yield Static("KV cache: waiting for the engine", id="pool-title")
        yield Static(id="numbers")
        for name, label in (("batch", "batch"), ("gen", "gen tok/s"), ("used", "blocks used")):
            with Horizontal(classes="spark-row", id=f"row-{name}"):
                yield Label(label, classes="spark-label")
                yield Spark(id=f"spark-{name}")
        yield BlockMapView(id="block-map")
        yield Legend(id="legend")
        yield Static("hover or click a block", id="block-detail")

    def show_stats(self, stats: EngineStats, tabs: Mapping[str, TabInfo]) -> None:
        """Draw a frame: `stats` and `tabs` (the app's, one call per frame of its
        FrameClock). Only the parts whose content changed are redrawn; a snapshot drawn
        already redraws only the legend, if the tabs changed."""
        tabs_changed = tabs != self.tabs
        self.tabs = tabs
        holders = tuple(dict.fromkeys(owner for owner in stats.blocks.request_owners if owner))
        if tabs_changed or holders != self._legend_holders:
            self._legend_holders = holders
            self.query_one(Legend).show(tabs, holders)
        if stats is self.stats:
            return
        self.stats = stats
        if self.capabilities is not None and not self.capabilities.block_map:
            self._show_remote(stats, self.capabilities.metrics)
            return
        busy = bool(stats.num_running or stats.num_waiting)
        self._history["batch"].append(stats.batch_size if busy else 0)
        self._history["gen"].append(stats.generation_tokens_per_s if busy else 0.0)
        self._history["used"].append(stats.blocks_in_use)
        self._show_history()
        # Fixed-size readouts: repaint without a layout pass, and only when their text changed.
        self._update_static("#pool-title", Text.assemble(
            ("KV cache ", "bold"), f"{_n(stats.num_blocks)} blocks × {stats.block_size} tokens"))
        self._update_static("#numbers", format_numbers(stats))
        owner_colour = {owner: info.colour for owner, info in tabs.items()}
        self.query_one(BlockMapView).show(stats.blocks, owner_colour)
        if self.focus_block is not None:
            self._describe()

    def show_trouble(self, trouble: str) -> None:
        """The engine stopped or does not respond: its last snapshot (a request running,
        blocks in use) no longer holds, so the numbers say what is wrong instead."""
        self.stats = None
        self._update_static("#pool-title", Text("KV cache: the engine is not serving", style="bold red"))
        self._update_static("#numbers", Text(trouble, style="red"))

    def _show_remote(self, stats: EngineStats, has_metrics: bool) -> None:
        """What a server's /metrics fills (the batch graph becomes the running requests');
        no block map, legend, block detail or blocks graph, and no graph without metrics."""
        if self.query_one("#block-map").display:
            for selector in ("#block-map", "#legend", "#block-detail", "#row-used"):
                self.query_one(selector).display = False
            self.query_one("#row-batch Label", Label).update("running")
        for selector in ("#row-batch", "#row-gen"):
            self.query_one(selector).display = has_metrics
        self._history["batch"].append(stats.num_running)
        self._history["gen"].append(stats.generation_tokens_per_s)
        self._show_history()
        self._update_static("#pool-title", Text("remote engine: no block map", style="bold"))
        self._update_static("#numbers", format_remote_numbers(stats, stats.kv_cache_usage, has_metrics))

    def _show_history(self) -> None:
        for name, values in self._history.items():
            self.query_one(f"#spark-{name}", Spark).data = tuple(values)  # reactive: redraws if changed

    def _update_static(self, selector: str, text: Text) -> None:
        if self._shown_text.get(selector) != text:
            self._shown_text[selector] = text
            self.query_one(selector, Static).update(text, layout=False)

    def on_block_map_view_hovered(self, message: BlockMapView.Hovered) -> None:
        view = self.query_one(BlockMapView)
        hovered = view.most_telling(message.block_ids)
        self.focus_block = self._pinned if hovered is None else hovered

    def on_block_map_view_selected(self, message: BlockMapView.Selected) -> None:
        self._pinned = message.block_id
        self.focus_block = message.block_id

    def watch_focus_block(self) -> None:
        self._describe()

    def _describe(self) -> None:
        detail = self.query_one("#block-detail", Static)
        block = self.focus_block
        if self.stats is None or block is None or block >= self.stats.num_blocks:
            detail.update(Text("hover or click a block", style="dim"), layout=False)
            return
        detail.update(describe_block(block, self.stats.blocks, self.stats.block_size,
                                     self.tabs, self.decode), layout=False)
