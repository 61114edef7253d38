"""The cluster on Ray: the master and each prefill, decode and mixed node run as named, detached Ray actors.

``pd-cluster ray start|scale|stop|status`` (see ``cli``) drive ``launcher.RayLauncher``; each actor
(``actors.RoleProcess``) runs the real ``pd-cluster <role>`` process and supervises it. Ray is
needed only when these run (the ``ray`` extra).
"""
