//! CIDR prefixes as users write them in policies (`cidr` peers) and ingress
//! allow-lists (`allowCidrs`): one parser, so both accept and refuse the same text.

use ipnet::IpNet;
use std::net::IpAddr;

/// Parses a prefix (`198.18.0.0/15`, `fd00::/8`) or one address (as `/32` or
/// `/128`), refusing a prefix with host bits set, whose error names the prefix the
/// user probably meant.
pub fn parse_cidr(text: &str) -> Result<IpNet, String> {
    if let Ok(addr) = text.parse::<IpAddr>() {
        return Ok(IpNet::from(addr));
    }
    let net: IpNet = text.parse().map_err(|_| {
        format!("{text:?} is not a CIDR prefix (address/length, e.g. 198.18.0.0/24) or an address")
    })?;
    if net.trunc() != net {
        return Err(format!("{text} has host bits set: write {}", net.trunc()));
    }
    Ok(net)
}

#[cfg(test)]
mod tests {
    use super::parse_cidr;

    #[test]
    fn prefixes_and_addresses_parse_and_host_bits_are_refused_with_the_meant_prefix() {
        assert_eq!(
            parse_cidr("198.18.0.0/15").unwrap().to_string(),
            "198.18.0.0/15"
        );
        assert_eq!(
            parse_cidr("198.18.1.2").unwrap().to_string(),
            "198.18.1.2/32"
        );
        assert_eq!(parse_cidr("fd00::1").unwrap().to_string(), "fd00::1/128");
        assert_eq!(
            parse_cidr("198.18.1.2/24").unwrap_err(),
            "198.18.1.2/24 has host bits set: write 198.18.1.0/24"
        );
        assert!(
            parse_cidr("198.18.0.0/33")
                .unwrap_err()
                .contains("not a CIDR")
        );
        assert!(parse_cidr("web").unwrap_err().contains("not a CIDR"));
    }
}
