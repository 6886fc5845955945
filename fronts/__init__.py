"""Where a request goes, decided the same way by each front a client may come through:
the custody router (services/router/) and the endpoint picker a Kubernetes gateway asks
(services/epp/). The replicas' registrations, the placement directory in Redis, the
prefix-aware choice, the session limits and the two-phase moves live here once, and
one decision (decision.py) is the only code of the fronts that uses them; "the router"
in these modules means whichever front runs them. A layer of its own: above the wire
contract (shared/), below the two fronts, which alone import it."""
