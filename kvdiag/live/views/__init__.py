"""The folds behind the views of ``kvdiag top`` that need no request or block state: each
takes its own event types (``handlers``) and builds its part of the snapshot. ``LiveState``
(kvdiag/live/state.py) dispatches events to them and keeps what several views share: the
pool ledger and the time bins; the requests', pool's and latency's folds are its siblings
(kvdiag/live/requests_fold.py, pool_fold.py, latency_fold.py). Pure: no UI library is imported here.
"""
