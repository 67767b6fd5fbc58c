"""The q/k gauge group of IP-Adapter attention: apply it (transforms), draw or search elements of it (generators),
and sweep a generation over several (sweep). docs/gauge.md says which statistics each subgroup leaves unchanged."""

from .generators import AdversarialGauge, RandomGauge, RowShift, adversarial_gauge, qk_gauge, resolve_gauge
from .sweep import DEFAULT_FACTORS, GAUGE_TABLE_COLUMNS, gauge_sweep, plot_gauge_sweep
from .transforms import GaugeConfig, apply_gauge, max_condition_number, plan_gauge

__all__ = [
    "DEFAULT_FACTORS",
    "GAUGE_TABLE_COLUMNS",
    "AdversarialGauge",
    "GaugeConfig",
    "RandomGauge",
    "RowShift",
    "adversarial_gauge",
    "apply_gauge",
    "gauge_sweep",
    "max_condition_number",
    "plan_gauge",
    "plot_gauge_sweep",
    "qk_gauge",
    "resolve_gauge",
]
