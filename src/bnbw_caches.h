/*
 * bnbw_caches.h - the machine's data caches as the schedules size their work by them: the
 * bytes of CPU 0's level-2 and level-3 data (or unified) cache and how many CPUs share its L3.
 *
 * Linux describes each cache in sysfs (cpu0/cache/indexN: level, type, size, shared_cpu_list),
 * and that is read first: it is what the kernel found, per cache instance.  sysconf's
 * _SC_LEVEL3_CACHE_SIZE is only a fallback: glibc derives it from CPUID and on some AMD guests
 * reports the whole package's L3 (384 MiB where one instance has 32 MiB).  Every reader gives
 * 0 for what it cannot tell; the caller picks a default.  Results never depend on these
 * figures, only speed does.
 */
#ifndef BNBW_CACHES_H
#define BNBW_CACHES_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#define BNBW__SYSFS_CACHE "/sys/devices/system/cpu/cpu0/cache/index"

/* The first line of a small text file, without its newline; 0 when it cannot be read. */
static int bnbw__read_line(const char *path, char *buf, size_t n)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    int ok = fgets(buf, (int)n, f) != NULL;
    fclose(f);
    if (ok)
        buf[strcspn(buf, "\n")] = '\0';
    return ok;
}

/* "32768K", "2M" or "512" as bytes; 0 when malformed. */
static long bnbw__parse_size(const char *text)
{
    char *end;
    long v = strtol(text, &end, 10);
    if (end == text || v <= 0)
        return 0;
    switch (*end) {
    case 'K': return v << 10;
    case 'M': return v << 20;
    case 'G': return v << 30;
    case '\0': return v;
    default: return 0;
    }
}

/* How many CPUs a list such as "0-7,64-71" names; 0 when malformed. */
static long bnbw__count_cpus(const char *list)
{
    long count = 0;
    const char *p = list;
    while (*p) {
        char *end;
        long lo = strtol(p, &end, 10), hi = lo;
        if (end == p || lo < 0)
            return 0;
        p = end;
        if (*p == '-') {
            hi = strtol(p + 1, &end, 10);
            if (end == p + 1 || hi < lo)
                return 0;
            p = end;
        }
        count += hi - lo + 1;
        if (*p == ',')
            ++p;
        else if (*p)
            return 0;
    }
    return count;
}

/* CPU 0's data or unified cache of `level` in sysfs: its bytes (and, when `sharers` is not
 * NULL, how many CPUs share it); 0 when sysfs does not say. */
static long bnbw__sysfs_cache(int level, long *sharers)
{
    char path[96], text[256];
    for (int index = 0; index < 16; ++index) {
        snprintf(path, sizeof path, BNBW__SYSFS_CACHE "%d/level", index);
        if (!bnbw__read_line(path, text, sizeof text))
            return 0;                   /* indices are consecutive: the last one was passed */
        if (atoi(text) != level)
            continue;
        snprintf(path, sizeof path, BNBW__SYSFS_CACHE "%d/type", index);
        if (!bnbw__read_line(path, text, sizeof text) || strcmp(text, "Instruction") == 0)
            continue;
        snprintf(path, sizeof path, BNBW__SYSFS_CACHE "%d/size", index);
        if (!bnbw__read_line(path, text, sizeof text))
            return 0;
        if (sharers) {
            snprintf(path, sizeof path, BNBW__SYSFS_CACHE "%d/shared_cpu_list", index);
            *sharers = bnbw__read_line(path, text, sizeof text) ? bnbw__count_cpus(text) : 0;
        }
        return bnbw__parse_size(text);
    }
    return 0;
}

/* Bytes of the level-`level` data cache (2 or 3) of one core, 0 when unknown. */
static long bnbw_cache_bytes(int level)
{
    long v = bnbw__sysfs_cache(level, NULL);
    if (v > 0)
        return v;
#if defined(_SC_LEVEL2_CACHE_SIZE) && defined(_SC_LEVEL3_CACHE_SIZE)
    v = sysconf(level == 2 ? _SC_LEVEL2_CACHE_SIZE : _SC_LEVEL3_CACHE_SIZE);
    return v > 0 ? v : 0;
#else
    return 0;
#endif
}

static long bnbw_online_cpus(void)
{
#ifdef _SC_NPROCESSORS_ONLN
    long v = sysconf(_SC_NPROCESSORS_ONLN);
    return v > 0 ? v : 1;
#else
    return 1;
#endif
}

/* CPUs sharing CPU 0's L3: what sysfs lists, else every online CPU. */
static long bnbw_l3_sharers(void)
{
    long sharers = 0;
    if (bnbw__sysfs_cache(3, &sharers) > 0 && sharers > 0)
        return sharers;
    return bnbw_online_cpus();
}

#endif /* BNBW_CACHES_H */
