//! Leases in Redis: a key holding its owner's token that lapses unless renewed (a sale's
//! load lock, a worker id, the audit). The scripts renew or give one back only while its
//! owner still holds it, so a holder whose lease ran out can never touch its successor's.

/// `renew_lock.lua`: KEYS[1] lease, ARGV[1] owner token, ARGV[2] lease ms; 1 renewed, 0 lost.
pub const RENEW_LUA: &str = include_str!("renew_lock.lua");

/// `unlock.lua`: KEYS[1] lease, ARGV[1] owner token; deletes it only for its owner.
pub const UNLOCK_LUA: &str = include_str!("unlock.lua");

/// `forget_stale.lua`: KEYS[1] a sale's hash; deletes it when it was loaded into another
/// Redis server than this one (a failover, a restart with older data).
pub const FORGET_STALE_LUA: &str = include_str!("forget_stale.lua");
