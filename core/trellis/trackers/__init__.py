"""Experiment trackers: where per-step metrics go (registry ``trellis.trackers``)."""

from trellis.trackers.base import Tracker

__all__ = ["Tracker"]
