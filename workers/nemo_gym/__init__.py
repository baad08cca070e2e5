"""Driving a user's own NeMo Gym deployment (servers started by `ng_run`).

- `deployment`: find the servers of a deployment from its head server (agents, resources servers, models),
  without ever keeping the config's secrets.
- `rows`: a dataset row -> the JSON body of `POST {agent}/run`, exactly as `ng_collect_rollouts` builds it.
- `engine`: the collection engine's runs for agent jobs (`/run`) and for a remote verifier (`/verify`).
- `client`: `/aggregate_metrics` and other one-off calls.
"""
AGENT_FLAVOR = "nemo_gym_agent"  # EndpointSpec.base_urls are agent servers; EndpointSpec.model is the agent's name
HEAD_FLAVOR = "nemo_gym_head"  # EndpointSpec.base_urls[0] is a head server; agents are discovered at run start
FLAVORS = (AGENT_FLAVOR, HEAD_FLAVOR)
REMOTE_VERIFIER = "nemo_gym"  # verifier name: score with a resources server's /verify
