"""Slow, obviously correct references that the tests of more than one script compare with (plain Python floats)."""


def reference_gae(rewards, values, dones, next_value, next_done, gamma, lam):
    """A_t = sum_l (gamma*lam)^l delta_{t+l}, summed forward until the episode ends (plain Python floats)."""
    T, N = len(rewards), len(rewards[0])
    # episode_over[t][i]: the transition at t is the last of its episode
    over = [[(dones[t + 1][i] if t + 1 < T else next_done[i]) for i in range(N)] for t in range(T)]
    v_next = [[(values[t + 1][i] if t + 1 < T else next_value[i]) for i in range(N)] for t in range(T)]
    adv = [[0.0] * N for _ in range(T)]
    for i in range(N):
        for t in range(T):
            total, weight = 0.0, 1.0
            for k in range(t, T):
                delta = rewards[k][i] + (0.0 if over[k][i] else gamma * v_next[k][i]) - values[k][i]
                total += weight * delta
                if over[k][i]:
                    break
                weight *= gamma * lam
            adv[t][i] = total
    return adv
