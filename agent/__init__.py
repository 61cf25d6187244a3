"""weightship node agent: verified fetch, versions side by side, atomic switches, a local API.

Run it as ``weightship-agent`` (``python -m agent``); ``docs/agent.md`` describes the on-disk
layout, the states, retention and the local API. The agent imports only ``weightship`` (the
shared contract), never another component.
"""
