----------------------- MODULE MCTenancyDraftPerRequest -----------------------
(* Broken variant: row versions are kept per KV tenancy (the request), not *)
(* per write, so a rewrite within one tenancy has the version of the       *)
(* rejected write before it; when the rejected write lands late it is not  *)
(* older than the rewrite and overwrites it, and a hit reads the rejected  *)
(* row.                                                                    *)
EXTENDS TenancyDraft

VersionOfTenancy(w) == ten
=============================================================================
