"""The control plane: the multi-tenant scheduling core (scheduler/), and later the API and store around it."""
