"""An executor of a next build whose session-state blobs are of the next format version
(services/executor/tiers/blob_store.py): the rolling-update drill runs a replica of it
beside one of this build (tests/test_epp.py), so a drain between the two builds meets a
blob it must refuse, never read."""

from services.executor.service import main
from services.executor.tiers import blob_store

blob_store.VERSION += 1

if __name__ == "__main__":
    main()
