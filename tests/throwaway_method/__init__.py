"""A throwaway drafting method defined outside draftsmith (tests/test_methods.py): its files, one per stage, with
the hooks draftsmith.core.methods names; the test adds it with one row (`methods.register`)."""
