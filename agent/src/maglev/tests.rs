use super::*;

fn keys(n: usize) -> Vec<BackendKey> {
    (0..n)
        .map(|i| {
            BackendKey(SocketAddr::from((
                [10, 0, (i / 250) as u8, (i % 250) as u8 + 1],
                8080,
            )))
        })
        .collect()
}

fn counts(t: &Maglev, n: usize) -> Vec<usize> {
    let mut c = vec![0; n];
    for b in t.slots() {
        c[b] += 1;
    }
    c
}

#[test]
fn spread_is_even() {
    // Maglev fills round-robin, one slot per backend per round, until the table
    // is full: every backend ends with floor(M/N) or ceil(M/N) slots.
    for n in [1, 3, 7, 10, 100] {
        let t = Maglev::new(&keys(n), DEFAULT_TABLE_SIZE).unwrap();
        let m = DEFAULT_TABLE_SIZE as usize;
        for (i, c) in counts(&t, n).into_iter().enumerate() {
            assert!(
                c == m / n || c == m.div_ceil(n),
                "n={n} backend {i} has {c}"
            );
        }
    }
}

fn table(t: &Maglev) -> Vec<u32> {
    t.slots().map(|i| i as u32).collect()
}

fn changed(a: &[u32], b: &[u32], map: impl Fn(u32) -> u32) -> f64 {
    let d = a.iter().zip(b).filter(|(x, y)| map(**x) != **y).count();
    d as f64 / a.len() as f64
}

#[test]
fn removing_or_adding_one_moves_about_one_nth() {
    for n in [3, 7, 10, 50] {
        let all = keys(n);
        let full = Maglev::new(&all, DEFAULT_TABLE_SIZE).unwrap();
        for gone in [0, n / 2, n - 1] {
            let mut rest = all.clone();
            rest.remove(gone);
            let less = Maglev::new(&rest, DEFAULT_TABLE_SIZE).unwrap();
            // Indices above `gone` shift down by one in the smaller list.
            let map = |i: u32| if i as usize > gone { i - 1 } else { i };
            let frac = changed(&table(&full), &table(&less), map);
            assert!(frac <= 1.0 / n as f64 + 0.01, "n={n} remove {gone}: {frac}");
            // Adding it back is the same change the other way.
            let frac = changed(&table(&less), &table(&full), |i| {
                if i as usize >= gone { i + 1 } else { i }
            });
            assert!(frac <= 1.0 / n as f64 + 0.01, "n={n} add {gone}: {frac}");
        }
    }
}

#[test]
fn order_does_not_matter_and_table_is_golden() {
    let k = keys(3);
    let a = Maglev::new(&k, DEFAULT_TABLE_SIZE).unwrap();
    let rev: Vec<_> = k.iter().rev().copied().collect();
    let b = Maglev::new(&rev, DEFAULT_TABLE_SIZE).unwrap();
    let b_mapped: Vec<u32> = table(&b).iter().map(|&i| 2 - i).collect();
    assert_eq!(table(&a), b_mapped);
    assert_eq!(&table(&a)[..12], &GOLDEN[..]);
    assert_eq!(a.lookup(0), Some(GOLDEN[0] as usize));
    assert_eq!(a.lookup(DEFAULT_TABLE_SIZE + 1), Some(GOLDEN[1] as usize));
}
const GOLDEN: [u32; 12] = [0, 0, 2, 0, 0, 2, 0, 2, 2, 0, 1, 2];

#[test]
fn bad_sizes_and_empty() {
    let k = keys(3);
    assert_eq!(
        Maglev::new(&k, 16380),
        Err(MaglevError::NotPrime { size: 16380 })
    );
    assert_eq!(
        Maglev::new(&k, 2),
        Err(MaglevError::BadSize {
            size: 2,
            backends: 3
        })
    );
    assert!(matches!(
        Maglev::new(&k, 0),
        Err(MaglevError::BadSize { .. })
    ));
    assert!(matches!(
        Maglev::new(&k, 131_101),
        Err(MaglevError::BadSize { .. })
    ));
    assert!(Maglev::new(&k, 3).is_ok());
    let dup = [k[0], k[1], k[0]];
    assert_eq!(
        Maglev::new(&dup, 7),
        Err(MaglevError::Duplicate { backend: k[0].0 })
    );
    let empty = Maglev::new(&[], DEFAULT_TABLE_SIZE).unwrap();
    assert_eq!(empty.lookup(42), None);
    assert!(empty.is_empty());
}

#[test]
fn mapped_slots_follow_the_indexes_in_every_width() {
    for n in [0, 3, 300] {
        let t = Maglev::new(&keys(n), 1021).unwrap();
        let ids: Vec<u32> = (0..n as u32).map(|i| i * 7 + 5).collect();
        let want: Vec<u32> = t.slots().map(|i| ids[i]).collect();
        assert_eq!(t.map_slots(&ids), want, "{n} backends");
        assert_eq!(want.len(), if n == 0 { 0 } else { 1021 });
    }
}

#[test]
fn primality_of_large_sizes_does_not_overflow() {
    assert!(is_prime(4_294_967_291)); // the largest 32-bit prime
    assert!(!is_prime(u32::MAX));
    assert!(is_prime(DEFAULT_TABLE_SIZE) && is_prime(MAX_TABLE_SIZE));
    assert!(!is_prime(0) && !is_prime(1) && !is_prime(16383));
}

#[test]
fn wide_backend_sets_keep_every_index() {
    // 300 backends need two bytes per slot; every backend still owns slots.
    let n = 300;
    let t = Maglev::new(&keys(n), DEFAULT_TABLE_SIZE).unwrap();
    assert!(matches!(t.slots, Slots::U16(_)));
    assert_eq!(t.len(), DEFAULT_TABLE_SIZE as usize);
    assert!(
        counts(&t, n)
            .iter()
            .all(|&c| c >= DEFAULT_TABLE_SIZE as usize / n)
    );
}

/// Two backends on one address with different ports are two identities: each its
/// own permutation and its share of the slots, and the port alone changes the table.
#[test]
fn backends_on_one_address_are_told_apart_by_port() {
    let key = |port| BackendKey(SocketAddr::from(([127, 0, 0, 1], port)));
    let pair = [key(8081), key(8082)];
    let t = Maglev::new(&pair, DEFAULT_TABLE_SIZE).unwrap();
    let m = DEFAULT_TABLE_SIZE as usize;
    assert_eq!(counts(&t, 2), [m.div_ceil(2), m / 2]);
    let moved = Maglev::new(&[key(8081), key(8083)], DEFAULT_TABLE_SIZE).unwrap();
    assert_ne!(table(&t), table(&moved), "the port is part of the hash");
    assert_ne!(pair[0].words(), pair[1].words());
}
