"""Pulling a certified training state from its holders (sans-I/O).

- :mod:`chaos_flwr.pull.messages`: the requests and replies (one frozen class each), how a
  holder answers them (:func:`~chaos_flwr.pull.messages.serve`);
- :mod:`chaos_flwr.pull.negotiation`: the puller's state machine
  (:class:`~chaos_flwr.pull.negotiation.PullNegotiation`), driven by a joiner and by a
  restarted ServerApp alike;
- :mod:`chaos_flwr.pull.saved`: a pull in progress as explicit, versioned values.

Carriers (Flower's relay, direct grpc links) live in :mod:`chaos_flwr.flower`.
"""
