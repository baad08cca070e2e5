"""API tokens in the admin: knox's AuthToken admin lists digests, owners and expiries (a staff user can
revoke a token there but never read one: only its hash is stored)."""
