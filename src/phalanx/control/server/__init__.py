"""``phalanx server``: the REST API (app.py), authentication (auth.py), job states (lifecycle.py), the
scheduling loop (loop.py) and what it reads of run directories (views.py)."""
