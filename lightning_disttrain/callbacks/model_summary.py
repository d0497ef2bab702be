"""Lightning's rich model summary without a FLOPs column of zeros.

Lightning 2.6 counts FLOPs only by running the module's ``example_input_array`` under torch's
FLOP counter, on rank 0 alone. ``GPTModule`` has none (that forward, on one rank of a sharded
model, would wait for the other ranks' all-gathers), so every row and "Total FLOPs" read 0: a wrong
number, not a missing one. ``summarize_without_zero_flops`` prints the same table and totals
without them when the count is 0, and Lightning's own when a module does count FLOPs; the
``MFUMonitor`` callback reports the model's real FLOP rate. The CLI installs it on Lightning's
default ``RichModelSummary`` (``cli.DistTrainCLI.instantiate_trainer``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count

_RIGHT = ("Params", "Params per Device", "In sizes", "Out sizes")


def summarize_without_zero_flops(summary_data: list[tuple[str, list[str]]], total_parameters: int,
                                 trainable_parameters: int, model_size: float, total_training_modes: dict[str, int],
                                 total_flops: int, **summarize_kwargs: Any) -> None:
    """``RichModelSummary.summarize``'s signature and table, the FLOPs left out when they are 0."""
    if total_flops:
        return RichModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                          total_training_modes, total_flops, **summarize_kwargs)
    from rich import get_console
    from rich.table import Table

    columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
    table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
    for name, _ in columns:
        table.add_column(name, justify="right" if name in _RIGHT else "left", style="dim" if name == " " else None,
                         no_wrap=name == "Name")
    for row in zip(*(values for _, values in columns)):
        table.add_row(*row)
    console = get_console()
    console.print(table)
    grid = Table.grid(expand=True)
    grid.add_column()
    for label, value in (("Trainable params", get_human_readable_count(int(trainable_parameters))),
                         ("Non-trainable params", get_human_readable_count(int(total_parameters - trainable_parameters))),
                         ("Total params", get_human_readable_count(int(total_parameters))),
                         ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
                         ("Modules in train mode", total_training_modes["train"]),
                         ("Modules in eval mode", total_training_modes["eval"])):
        grid.add_row(f"[bold]{label}[/]: {value}")
    console.print(grid)
    return None
