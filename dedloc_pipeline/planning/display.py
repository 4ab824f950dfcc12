"""``dedloc cost`` for people: the plan in a line, the traffic, the dollars at each provider."""

from __future__ import annotations

from ..protocol.clock import duration
from .estimate import HOUR, Estimate
from .prices import PriceTable


def show(e: Estimate, prices: PriceTable, console) -> None:
    """The estimate as three parts: a headline, the traffic table, the dollars table."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    per_hour = HOUR / e.round_s
    plan = f"{e.peers} volunteers × {e.days:g} day{'s' * (e.days != 1)}"
    console.print(Text(f"{e.preset}: {e.n_params:,} parameters in {e.chunks} chunks; {plan} at {e.samples_per_s:g} "
                       f"samples/s each, target {e.target}: a round every {duration(e.round_s)} ({per_hour:,.1f} "
                       f"an hour, {e.rounds:,.0f} in the run)", style="bold"))
    if e.aggregators:
        console.print(Text(f"audits: {e.audited_chunks} of the {e.chunks} chunks recomputed by the organizer in each "
                           f"exchange a round; a lie over one chunk of a part survives a round's audit with "
                           f"probability {e.audit_survival:.3f}, over a whole part never (docs/aggregators.md; "
                           "more chunks a part, --chunks-per-part, make audits cheaper)", style="dim"))
    console.print("\nrequests per volunteer-hour and GB per volunteer-day (the scheduler's and an aggregator's: "
                  "per hour, per day)")
    traffic = Table(box=box.SIMPLE_HEAD, show_edge=False)
    rates = [e.volunteer_hour, e.scheduler_hour] + ([e.aggregator_hour] if e.aggregator_hour else [])
    for name in ("", "volunteer", "scheduler", "aggregator")[:len(rates) + 1]:
        traffic.add_column(name, justify="right" if name else "left")
    for kind in ("get", "put", "head", "list"):
        traffic.add_row(f"{kind.upper()} requests", *(f"{r.requests.get(kind, 0):,.0f}" for r in rates))
    gb = prices.gigabyte / 24
    traffic.add_row("GB up (written)", *(f"{r.bytes_up / gb:,.{2 if i == 0 else 1}f}" for i, r in enumerate(rates)))
    traffic.add_row("GB down (read: egress)",
                    *(f"{r.bytes_down / gb:,.{2 if i == 0 else 1}f}" for i, r in enumerate(rates)))
    console.print(traffic)

    console.print(f"dollars at the list prices of {prices.date}")
    dollars = Table(box=box.SIMPLE_HEAD, show_edge=False)
    dollars.add_column("")
    names = list(e.cost)
    for name in names:
        dollars.add_column(name.upper(), justify="right")
    where = "outside the provider's region" if e.scheduler_egress else "in the provider's region"

    def row(label: str, values: list[float], digits: int = 2) -> None:
        dollars.add_row(label, *(f"{x:,.{digits}f}" for x in values))

    c = [e.cost[n] for n in names]
    row("$ per volunteer-day, requests", [sum(x.volunteer_day.requests.values()) for x in c], 3)
    row("$ per volunteer-day, egress", [x.volunteer_day.egress for x in c], 3)
    row("$ per volunteer-day", [x.volunteer_day.total for x in c], 3)
    row(f"$ per day, the scheduler ({where})", [x.scheduler_day.total for x in c])
    if e.aggregators:
        row(f"$ per day, each of {e.aggregators} volunteer aggregators (besides its volunteer-day)",
            [x.aggregator_day.total for x in c])
    row(f"$ storage, {e.storage_gb:,.1f} GB on average", [x.storage for x in c])
    row(f"$ whole run ({plan}, egress included)", [x.run for x in c])
    dollars.add_row("scheduler's share", *(f"{100 * x.scheduler_share:.0f}%" for x in c))
    console.print(dollars)
    console.print(Text("; ".join(f"{n.upper()}: {prices.providers[n].name}" for n in names)
                       + ". Free tiers not counted; docs/cost.md says what is modeled.", style="dim"))
