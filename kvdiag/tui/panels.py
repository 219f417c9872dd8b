"""The panels of ``kvdiag top``, in the order the screen shows them. Each family has its module
(``panels_*``); what they share (the box that renders only from the latest snapshot, fitted to
its size) is :mod:`kvdiag.tui.panel_base`."""

from __future__ import annotations

from kvdiag.tui.panel_base import Panel
from kvdiag.tui.panels_alerts import AlertsPanel
from kvdiag.tui.panels_memory import MemoryPanel, PoolPanel
from kvdiag.tui.panels_requests import LatencyPanel, RequestsPanel
from kvdiag.tui.panels_shadow import CompressionPanel, LocalityPanel
from kvdiag.tui.panels_sharing import SharingPanel


PANELS: tuple[type[Panel], ...] = (MemoryPanel, PoolPanel, LatencyPanel, SharingPanel, CompressionPanel,
                                   LocalityPanel, RequestsPanel, AlertsPanel)
