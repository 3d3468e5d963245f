"""The swarm's protocol rules, sans-I/O: scheduling, peers, stalls, seeding, uploads,
reachability."""
