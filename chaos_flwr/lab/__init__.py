"""The lab: run, break and measure chaos-flwr on Flower's engines (not needed to use it).

- :mod:`~chaos_flwr.lab.scenario`: the churn scenario format (YAML);
- :mod:`~chaos_flwr.lab.churn`: a ClientApp wrapper that plays a scenario on the client side;
- :mod:`~chaos_flwr.lab.processes`, :mod:`~chaos_flwr.lab.launch`: process trees stopped by
  pid; what every Flower launch shares;
- :mod:`~chaos_flwr.lab.simulation`, :mod:`~chaos_flwr.lab.deployment`: run an app on the
  simulation or the deployment engine from Python, bounded and cleaned up;
- :mod:`~chaos_flwr.lab.demo`, :mod:`~chaos_flwr.lab.report`, :mod:`~chaos_flwr.lab.render`:
  ``chaos-flwr demo`` and its report (JSON, plot, terminal tables);
- :mod:`~chaos_flwr.lab.overhead`, :mod:`~chaos_flwr.lab.deploy_churn`: the Flower benches;
- :mod:`~chaos_flwr.lab.example`: where the multi-institution example lives;
- :mod:`~chaos_flwr.lab.settings`: the lab's own tunables (launch bounds, the demo's).

Importing this package imports none of its modules.
"""
